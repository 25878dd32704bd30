"""Draft-tree construction: the B most probable prefixes of a block draft.

DDTree (Ringel et al.) scores a prefix (t_1..t_d) of the draft block by the product of the
drafter's per-position marginals, sum_i log q_i(t_i), and verifies the B best prefixes as a tree.
The reference builds them with a best-first heap on the CPU, one request at a time. Here the same
set is found with fixed-shape tensor ops, batched, on any device:

* Only the top K = min(B, V) tokens of each position can appear (the paper's Lemma 1).
* Because every node at depth d ranks its children with the same marginal q_{d+1}, a top-B node
  at depth d has its parent among the top-B nodes at depth d-1.  So a beam of width B per depth,
  expanded over the K candidates of the next position, holds every depth-d node of the answer.
* One global selection over the L beams gives the B best prefixes.

Order and ties.  Candidates are ranked by (score desc, depth asc, rank tuple lexicographic asc).
This is a strict total order in which a parent always precedes its children (its score is at
least theirs and its depth is smaller), so the selected set is prefix-closed and the node order
is best-first with parents first, as the heap's pop order is.  Within a depth the beam is kept
in lexicographic rank order, so a stable sort realises the tie rule with no extra key.
"""

from __future__ import annotations

import torch

from ddtree_sglang.tree.draft_tree import (DraftTree, TopLogProbs, check_budget, count_prefixes,
                                      torch_top_log_probs)

__all__ = ["DraftTree", "build_draft_tree", "chain_tree", "check_budget", "count_prefixes",
           "truncate_tree"]


def truncate_tree(tree: DraftTree, budget: int) -> DraftTree:
    """The tree of the `budget` best prefixes, taken from a larger tree without rebuilding.

    Exact because the builder's output is best-first and prefix-closed: a prefix scores at most
    its parent (log-probabilities only fall along a path), so the b best prefixes of a request
    are the first b nodes of its B-best tree for every b <= B, and each of their parents comes
    before them.  This is what lets one tree stage serve every candidate budget.  Budget 0 is
    the root alone: a step that verifies no draft (plain decoding)."""
    if not 0 <= budget <= tree.budget:
        raise ValueError(f"budget must be in 0..{tree.budget} (the tree's size); got {budget}")
    return DraftTree(tree.tokens[:, :budget], tree.parents[:, :budget],
                     tree.depths[:, :budget], tree.scores[:, :budget])


def chain_tree(draft_logits: torch.Tensor, top: TopLogProbs = torch_top_log_probs) -> DraftTree:
    """The DFlash chain as a tree: the argmax token of every position, one node per depth."""
    batch, depth, _ = draft_logits.shape
    best, tokens = (t.squeeze(-1) for t in top(draft_logits, 1))
    device = draft_logits.device
    parents = torch.arange(-1, depth - 1, device=device).expand(batch, depth).contiguous()
    depths = torch.arange(1, depth + 1, device=device).expand(batch, depth).contiguous()
    return DraftTree(tokens, parents, depths, best.cumsum(dim=-1))


def build_draft_tree(draft_logits: torch.Tensor, budget: int,
                     top: TopLogProbs = torch_top_log_probs) -> DraftTree:
    """Select the `budget` most probable draft prefixes of every request as a tree.

    draft_logits: [batch, depth, vocab]; row d holds the drafter's logits for the token d+1
    steps after the root.  `top`: the top-k of the positions (kernels.choice.Kernels passes
    its own).  Runs without host synchronisation; the loop is over depth only.
    """
    batch, depth, vocab = draft_logits.shape
    check_budget(budget, depth, vocab)
    device = draft_logits.device
    k = min(budget, vocab)
    top_lp, top_ids = top(draft_logits, k)  # [batch, depth, k], sorted desc

    # Depth 1: the beam is the top-k tokens themselves, already in rank order.
    width = min(budget, k)
    beam_scores = top_lp[:, 0, :width]
    beam_tokens = top_ids[:, 0, :width]
    beam_parent = torch.full((batch, width), -1, dtype=torch.long, device=device)
    level_scores, level_tokens, level_parents = [beam_scores], [beam_tokens], [beam_parent]

    for d in range(1, depth):
        cand = (beam_scores.unsqueeze(-1) + top_lp[:, d, None, :]).reshape(batch, -1)
        new_width = min(budget, cand.shape[1])
        # Candidate index w*k + r is lexicographic rank order: the beam is kept sorted that way.
        order = torch.sort(cand, dim=-1, descending=True, stable=True).indices[:, :new_width]
        chosen = torch.sort(order, dim=-1).values  # back to lexicographic order
        beam_scores = cand.gather(1, chosen)
        beam_parent = torch.div(chosen, k, rounding_mode="floor")
        beam_tokens = top_ids[:, d, :].gather(1, chosen % k)
        level_scores.append(beam_scores)
        level_tokens.append(beam_tokens)
        level_parents.append(beam_parent)

    widths = [s.shape[1] for s in level_scores]
    offsets = [0]
    for w in widths[:-1]:
        offsets.append(offsets[-1] + w)
    all_scores = torch.cat(level_scores, dim=1)  # depth-major, lexicographic within a depth
    all_tokens = torch.cat(level_tokens, dim=1)
    # Parent of each candidate as a flat index into all_* (-1 for depth 1).
    all_parent_flat = torch.cat(
        [level_parents[0]]
        + [level_parents[d] + offsets[d - 1] for d in range(1, len(level_parents))],
        dim=1,
    )
    all_depths = torch.cat(
        [torch.full((w,), d + 1, dtype=torch.long, device=device) for d, w in enumerate(widths)]
    ).expand(batch, -1)

    # Global best-first order: stable sort keeps (depth asc, lexicographic asc) among ties.
    order = torch.sort(all_scores, dim=-1, descending=True, stable=True).indices[:, :budget]
    total = all_scores.shape[1]
    # Where each flat candidate landed in the output (budget = not selected).
    slot = torch.full((batch, total), budget, dtype=torch.long, device=device)
    slot.scatter_(1, order, torch.arange(budget, device=device).expand(batch, -1))
    parent_flat = all_parent_flat.gather(1, order)
    parents = torch.where(
        parent_flat < 0,
        torch.full_like(parent_flat, -1),
        slot.gather(1, parent_flat.clamp(min=0)),
    )
    return DraftTree(
        tokens=all_tokens.gather(1, order),
        parents=parents,
        depths=all_depths.gather(1, order),
        scores=all_scores.gather(1, order),
    )
