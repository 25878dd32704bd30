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

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees, B non-root nodes per request, in best-first order.

    tokens:  [batch, B] token id of each node.
    parents: [batch, B] index of the parent node in 0..B-1, -1 for children of the root.
             A parent always comes before its children.
    depths:  [batch, B] depth of each node, 1 = child of the root.
    scores:  [batch, B] float32 log-probability of the node's prefix under the draft.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def budget(self) -> int:
        return self.tokens.shape[1]


def count_prefixes(depth: int, vocab: int, budget: int) -> int:
    """Number of distinct non-empty prefixes reachable with per-depth top-min(B, V) tokens."""
    k = min(budget, vocab)
    total, width = 0, 1
    for _ in range(depth):
        width = width * k
        total += width
        if total >= budget:
            return total
    return total


def check_budget(budget: int, depth: int, vocab: int) -> None:
    """Raise ValueError naming the accepted range when `budget` cannot be filled."""
    if depth < 1:
        raise ValueError(f"draft depth must be >= 1, got {depth}")
    if budget < 1:
        raise ValueError(f"tree budget must be >= 1 (number of non-root nodes), got {budget}")
    available = count_prefixes(depth, vocab, budget)
    if budget > available:
        raise ValueError(
            f"tree budget {budget} exceeds the {available} distinct prefixes of a depth-{depth} "
            f"draft over {vocab} tokens; accepted: 1..{available}"
        )


def top_log_probs(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most probable tokens of every draft position and their float32 log-probabilities,
    sorted descending: [batch, depth, k] each.

    Top-k runs on the raw logits (softmax preserves order) and only the k winners are
    normalised, by one logsumexp per position, so no [batch, depth, vocab] float32 tensor is
    written (the full log_softmax cost ~1.5 ms per step at batch 64 on the Qwen3 vocabulary).
    """
    rows = draft_logits.numel() // draft_logits.shape[-1]
    if draft_logits.is_cuda and TOPK_KERNEL["enabled"] and rows <= TOPK_KERNEL["max_rows"]:
        from ddtree_sglang.kernels.topk import MAX_K, top_log_probs_triton

        if k <= MAX_K:
            return top_log_probs_triton(draft_logits, k)  # one pass for both
    values, ids = torch.topk(draft_logits, k, dim=-1)
    if draft_logits.is_cuda and LSE_KERNEL["enabled"]:  # one float32 pass, no float32 copy
        from ddtree_sglang.kernels.logsumexp import logsumexp_triton

        lse = logsumexp_triton(draft_logits)
    else:
        lse = torch.logsumexp(draft_logits.float(), dim=-1)
    return values.float() - lse.unsqueeze(-1), ids


# Whether top_log_probs may use the Triton logsumexp / the Triton top-k on CUDA;
# check_logsumexp_kernel / check_topk_kernel turn them off for the process if the kernel fails
# or disagrees on this GPU.  The Triton top-k (k repeated max passes over each 4,096-logit chunk,
# work that grows with rows x k) serves up to max_rows rows ([batch x depth] positions): in the
# H200 profile of 2026-12-03 (run 3, Qwen3 vocabulary, k = 15) it took 0.03 / 0.21 ms at 15 /
# 120 rows (batch 1 / 8; torch.topk + logsumexp 0.09 / 0.25 in run 2) but 1.60 ms at 960 rows
# (batch 64; torch 1.06 + 0.14): PyTorch's radix top-k wins there.  Between 120 and 960 rows it
# was not measured; 256 is the cut.
LSE_KERNEL = {"enabled": True}
TOPK_KERNEL = {"enabled": True, "max_rows": 256}


def _keep_kernel(switch: dict, reference: str, agrees: Callable[[], bool]) -> str | None:
    """Run a startup comparison; if it fails or disagrees, turn `switch` off and say why."""
    try:
        if agrees():
            return None
        why = f"it disagrees with {reference}"
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use it
        why = f"{type(exc).__name__}: {str(exc)[:200]}"
    switch["enabled"] = False
    return why


def check_topk_kernel(vocab: int, k: int, device, dtype: torch.dtype) -> str | None:
    """Compare the Triton top-k with torch.topk + logsumexp on this device once (startup),
    ties included; on failure or disagreement disable it and say why."""
    def agrees() -> bool:
        from ddtree_sglang.kernels.topk import MAX_K, is_valid_top_k, top_log_probs_triton

        if k > MAX_K:
            return True  # not used for this budget: torch.topk serves it
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn((3, 2, vocab), generator=gen, device=device).mul(4).to(dtype)
        x[1, 1] = x[1, 1].round()  # many exactly equal logits
        return is_valid_top_k(x, k, *top_log_probs_triton(x, k))

    return _keep_kernel(TOPK_KERNEL, "torch.topk", agrees)


def check_logsumexp_kernel(vocab: int, device, dtype: torch.dtype) -> str | None:
    """Compare the Triton logsumexp with torch's on this device once (startup); on failure or
    disagreement disable it and say why."""
    def agrees() -> bool:
        from ddtree_sglang.kernels.logsumexp import logsumexp_triton

        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn((3, vocab), generator=gen, device=device).mul(4).to(dtype)
        return torch.allclose(logsumexp_triton(x), torch.logsumexp(x.float(), -1),
                              rtol=1e-5, atol=1e-4)

    return _keep_kernel(LSE_KERNEL, "torch.logsumexp", agrees)


def truncate_tree(tree: DraftTree, budget: int) -> DraftTree:
    """The tree of the `budget` best prefixes, taken from a larger tree without rebuilding.

    Exact because the builder's output is best-first and prefix-closed: a prefix scores at most
    its parent (log-probabilities only fall along a path), so the b best prefixes of a request
    are the first b nodes of its B-best tree for every b <= B, and each of their parents comes
    before them.  This is what lets one tree stage serve every candidate budget."""
    if not 1 <= budget <= tree.budget:
        raise ValueError(f"budget must be in 1..{tree.budget} (the tree's size); got {budget}")
    return DraftTree(tree.tokens[:, :budget], tree.parents[:, :budget],
                     tree.depths[:, :budget], tree.scores[:, :budget])


def chain_tree(draft_logits: torch.Tensor) -> DraftTree:
    """The DFlash chain as a tree: the argmax token of every position, one node per depth."""
    batch, depth, _ = draft_logits.shape
    best, tokens = (t.squeeze(-1) for t in top_log_probs(draft_logits, 1))
    device = draft_logits.device
    parents = torch.arange(-1, depth - 1, device=device).expand(batch, depth).contiguous()
    depths = torch.arange(1, depth + 1, device=device).expand(batch, depth).contiguous()
    return DraftTree(tokens, parents, depths, best.cumsum(dim=-1))


def build_draft_tree(draft_logits: torch.Tensor, budget: int) -> DraftTree:
    """Select the `budget` most probable draft prefixes of every request as a tree.

    draft_logits: [batch, depth, vocab]; row d holds the drafter's logits for the token d+1
    steps after the root.  Runs without host synchronisation; the loop is over depth only.
    """
    batch, depth, vocab = draft_logits.shape
    check_budget(budget, depth, vocab)
    device = draft_logits.device
    k = min(budget, vocab)
    top_lp, top_ids = top_log_probs(draft_logits, k)  # [batch, depth, k], sorted desc

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
