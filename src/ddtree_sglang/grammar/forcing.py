"""Tokens the grammar forces, put into the draft tree: a *forced spine* at the root, and
*forced children* inside it.

In JSON mode and tool calls much of the output is fixed by the schema (key names, quotes,
colons, `"arguments": {`, closing brackets).  The DFlash drafter does not know the schema, so
where it guesses a forced token wrong the accepted path ends there.  The grammar, asked from
the request's committed state, says what it forces next (xgrammar's jump-forward string, or the
single token it allows); tokenized as the target would emit it (`encode`), the longest prefix
the grammar accepts token by token is the spine.

A DFlash block draft gives one distribution per position, conditioned on the context and not on
the other drafted tokens, and the tree is built from those per-position distributions.  So the
spine is placed by the draft logits alone (`force_draft_logits`): position d <= f gets the
spine's token with probability 1 (every other token a log-probability of -FORCED_GAP), and
the best-first tree puts the f spine nodes first, its score 0, then grows below them from the
drafter's distributions of positions f + 1 ..; the B nodes are counted as ever (a forced node
costs a verify row, not a guess).

Inside the tree, where the grammar state at a node admits exactly one token, that token is the
node's only child (`forced_child_tree`, with log-probability 0, its subtree growing from the
next positions' distributions): a best-first heap over the request's prefixes, on the host,
asking the grammar at each node it pops.

Exact, as everything else is: the target still chooses at every node under the grammar's mask,
and the walk follows its choices; only which tokens are verified changes.  Greedy: a spine
token the target would tokenize differently is simply not chosen there, and the step commits
the target's token instead (`SpineStats` counts how often).  Sampling: a spine's tokens are
proposals like any draft (only a single allowed token is certain); the target samples at every
node and the walk follows its draws, so the output's law is the target's, whatever the spine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

# Log-probability gap between a forced position's token and every other token: the spine's
# prefixes come before any other prefix at its depths (finite, so no NaN in the builders).
FORCED_GAP = 1e4


class ForcingMatcher(Protocol):
    def accept_token(self, token_id: int) -> bool: ...
    def rollback(self, num_tokens: int = 1) -> None: ...
    def find_jump_forward_string(self) -> str: ...
    def is_terminated(self) -> bool: ...


def forced_tokens(matcher: ForcingMatcher, encode: Callable[[str], list[int]],
                  limit: int) -> list[int]:
    """Up to `limit` tokens the grammar forces from the matcher's state: its jump-forward
    string, tokenized by `encode`, cut before the first token the grammar refuses (the matcher
    is left where it was)."""
    if limit <= 0 or matcher.is_terminated():
        return []
    text = matcher.find_jump_forward_string()
    if not text:
        return []
    spine: list[int] = []
    for token in encode(text)[:limit]:
        if not matcher.accept_token(token):
            break
        spine.append(token)
    if spine:
        matcher.rollback(len(spine))
    return spine


def forced_rows(spines: Sequence[Sequence[int]], depth: int) -> torch.Tensor:
    """[bs, depth] int64: each request's spine token at each drafted position, -1 past it."""
    rows = torch.full((len(spines), depth), -1, dtype=torch.int64)
    for r, spine in enumerate(spines):
        if spine:
            rows[r, :len(spine)] = torch.tensor(list(spine)[:depth], dtype=torch.int64)
    return rows


def force_draft_logits(draft_logits: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """[bs, L, V] drafter logits with each forced position (forced [bs, L] >= 0) made the spine
    token's certainty: 0 for it, -FORCED_GAP for every other token (fixed shapes, no host
    read: it runs inside the tree stage's CUDA graph).  Other positions are unchanged."""
    is_forced = forced >= 0
    row = torch.full_like(draft_logits, -FORCED_GAP)
    row.scatter_(2, forced.clamp(min=0).unsqueeze(-1), 0.0)
    return torch.where(is_forced.unsqueeze(-1), row, draft_logits)


@dataclass
class SpineStats:
    """How the spine did, per request step: spine tokens proposed, and accepted (committed as
    the target's own choices)."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    refused_first: int = 0  # steps whose first spine token the target did not choose

    def record(self, spine: Sequence[int], accepted_nodes: int) -> None:
        if not spine:
            return
        self.steps += 1
        self.proposed += len(spine)
        self.accepted += min(accepted_nodes, len(spine))
        self.refused_first += accepted_nodes == 0

    def __add__(self, other: "SpineStats") -> "SpineStats":
        return SpineStats(self.steps + other.steps, self.proposed + other.proposed,
                          self.accepted + other.accepted,
                          self.refused_first + other.refused_first)


def forced_child_tree(log_probs: torch.Tensor, budget: int,
                      forced_after: Callable[[tuple[int, ...]], int | None]):
    """One request's B best prefixes (a DraftTree of batch 1) where a node after which
    `forced_after(prefix)` names a token has that token as its only child, certain (log-prob
    0); every other node's children are the drafter's at the next position, best first.
    log_probs [depth, vocab]: the drafter's log-probabilities (forced spine positions already
    certain).  Prefixes come out best first, each parent before its children."""
    import heapq

    from ddtree_sglang.tree.draft_tree import DraftTree

    depth, vocab = log_probs.shape
    k = min(budget, vocab)
    top_lp, top_ids = torch.topk(log_probs.double(), k, dim=-1)
    lp, ids = top_lp.tolist(), top_ids.tolist()
    nodes: list[tuple[float, tuple[int, ...], int]] = []  # (score, prefix, parent)
    # entries: (-score, order, prefix, rank (None: forced), parent); `order` breaks ties
    # by push order, which is the builders' rank order within a parent
    heap: list = []
    counter = 0

    def children(prefix: tuple[int, ...], score: float, parent: int) -> None:
        nonlocal counter
        d = len(prefix)
        if d == depth:
            return
        forced = forced_after(prefix)
        if forced is not None:
            entry = (-score, counter, prefix + (forced,), None, parent)
        else:
            entry = (-(score + lp[d][0]), counter, prefix + (ids[d][0],), 0, parent)
        counter += 1
        heapq.heappush(heap, entry)

    children((), 0.0, -1)
    while heap and len(nodes) < budget:
        neg, _, prefix, rank, parent = heapq.heappop(heap)
        nodes.append((-neg, prefix, parent))
        d = len(prefix) - 1
        if rank is not None and rank + 1 < k:  # the next sibling at this position
            heapq.heappush(heap, (neg + lp[d][rank] - lp[d][rank + 1], counter,
                                  prefix[:-1] + (ids[d][rank + 1],), rank + 1, parent))
            counter += 1
        children(prefix, -neg, len(nodes) - 1)
    return DraftTree(tokens=torch.tensor([[p[-1] for _, p, _ in nodes]]),
                     parents=torch.tensor([[q for _, _, q in nodes]]),
                     depths=torch.tensor([[len(p) for _, p, _ in nodes]]),
                     scores=torch.tensor([[sc for sc, _, _ in nodes]], dtype=torch.float32))

