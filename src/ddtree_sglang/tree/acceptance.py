"""Acceptance: walk each request's tree along the target's own choices.

At every tree node the target makes one choice: its argmax (greedy) or one sample from its
processed distribution (sampling).  Starting at the root, the walk moves to the child whose token
equals the target's choice at the current node, and stops where no child matches; the target's
choice there is the bonus token.  Sibling tokens are distinct, so at most one child matches and
the accepted nodes form a path.  Every emitted token is the target's own choice given its prefix,
so greedy output equals the target's greedy output and sampled output follows the target's
distribution (the tree depends only on the context, not on the target's samples).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Acceptance:
    """accept_path [bs, max_depth + 1]: tree indices of the root and accepted nodes by depth,
    -1 past the end.  accept_len [bs]: accepted draft nodes + 1 (counts the bonus token, i.e.
    the number of tokens committed this step).  bonus [bs]: the target's choice at the last
    accepted node.  accepted [bs, N]: membership mask of the path (root included)."""

    accept_path: torch.Tensor
    accept_len: torch.Tensor
    bonus: torch.Tensor
    accepted: torch.Tensor


def accept_tree(draft_tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                target_choice: torch.Tensor, max_depth: int) -> Acceptance:
    """draft_tokens, parents, depths, target_choice: [bs, N] over tree indices (root at 0,
    parents -1 at the root).  Vectorized over the batch; loops over depth only; no host sync."""
    bs, n = draft_tokens.shape
    device = draft_tokens.device
    safe_par = parents.clamp(min=0)
    # A node matches when its token is the target's choice at its parent.
    matches = draft_tokens == target_choice.gather(1, safe_par)
    matches[:, 0] = True
    accepted = matches.clone()
    for _ in range(max_depth):  # accepted = matches along the whole ancestor chain
        accepted = matches & accepted.gather(1, safe_par)
    accepted[:, 0] = True
    accept_len = accepted.sum(dim=1)  # root + accepted nodes = nodes + bonus
    path = torch.full((bs, max_depth + 1), -1, dtype=torch.long, device=device)
    slot = torch.where(accepted, depths, torch.full_like(depths, max_depth + 1))
    idx = torch.arange(n, device=device).expand(bs, n)
    scratch = torch.full((bs, max_depth + 2), -1, dtype=torch.long, device=device)
    scratch.scatter_(1, slot, idx)
    path = scratch[:, : max_depth + 1]
    last = path.gather(1, (accept_len - 1).unsqueeze(1)).squeeze(1)
    bonus = target_choice.gather(1, last.unsqueeze(1)).squeeze(1)
    return Acceptance(accept_path=path, accept_len=accept_len, bonus=bonus, accepted=accepted)


def committed_tokens(draft_tokens: torch.Tensor, acc: Acceptance) -> torch.Tensor:
    """[bs, max_depth + 1] tokens emitted this step: the accepted draft tokens then the bonus,
    padded with -1.  Entry j < accept_len is valid (the root itself is not re-emitted)."""
    bs, width = acc.accept_path.shape
    nodes = acc.accept_path[:, 1:]
    toks = draft_tokens.gather(1, nodes.clamp(min=0))
    out = torch.full((bs, width), -1, dtype=torch.long, device=draft_tokens.device)
    out[:, : width - 1] = torch.where(nodes >= 0, toks, out[:, : width - 1])
    out.scatter_(1, (acc.accept_len - 1).unsqueeze(1), acc.bonus.unsqueeze(1))
    return out


def best_path_acceptance(parents: torch.Tensor, depths: torch.Tensor,
                         target_choice: torch.Tensor, max_depth: int,
                         forced_len: torch.Tensor) -> Acceptance:
    """A benchmark's forced acceptance (SGLang's SGLANG_SIMULATE_ACC_LEN, DDTREE's
    SGLANG_DDTREE_SIMULATE_ACC): each request commits forced_len [bs] tokens, at most its
    tree's nodes and max_depth + 1.  The accepted nodes are the tree's best path (the
    first-child chain from the root: the builder's nodes are best first) and, where that path
    ends sooner, the next nodes in the builder's order, so that a tree of any shape (random
    weights draft bushy trees one node deep) commits the drawn length; the bonus is the
    target's choice at the last one.  Not the target's output: a way to serve models whose
    drafts nobody would accept at a published acceptance; the step's cost depends on the
    length committed, not on which nodes."""
    bs, n = parents.shape
    device = parents.device
    idx = torch.arange(n, device=device).expand(bs, n)
    first_child = torch.full((bs, n + 1), n, dtype=torch.long, device=device)
    first_child.scatter_reduce_(1, (parents + 1).clamp(min=0), idx, reduce="amin")
    first_child = first_child[:, 1:]  # column p holds the first child of p (n: none)
    # order key: the chain's nodes by depth first, then every other node by its index
    key = n + idx
    key[:, 0] = 0
    node = torch.zeros(bs, dtype=torch.long, device=device)
    alive = torch.ones(bs, dtype=torch.bool, device=device)
    for d in range(1, min(max_depth, n - 1) + 1):
        child = first_child.gather(1, node.unsqueeze(1)).squeeze(1)
        alive = alive & (child < n)
        node = torch.where(alive, child, node)
        old = key.gather(1, node.unsqueeze(1)).squeeze(1)
        key.scatter_(1, node.unsqueeze(1), torch.where(alive, d, old).unsqueeze(1))
    width = min(n, max_depth + 1)
    order = key.argsort(dim=1)[:, :width]
    accept_len = forced_len[:bs].clamp(min=1, max=width)
    path = torch.full((bs, max_depth + 1), -1, dtype=torch.long, device=device)
    path[:, :width] = torch.where(torch.arange(width, device=device) < accept_len.unsqueeze(1),
                                  order, torch.full_like(order, -1))
    accepted = torch.zeros((bs, n), dtype=torch.bool, device=device)
    accepted.scatter_(1, path.clamp(min=0), True)  # -1 entries mark the root, accepted anyway
    last = path.gather(1, (accept_len - 1).unsqueeze(1)).squeeze(1)
    bonus = target_choice.gather(1, last.unsqueeze(1)).squeeze(1)
    return Acceptance(accept_path=path, accept_len=accept_len, bonus=bonus, accepted=accepted)


def curve_tau(curve: tuple[tuple[int, float], ...], budget: int) -> float:
    """A simulated accept length at `budget` from a curve of (budget, tau) points sorted by
    budget: linear in log2(budget) between the two points around it (acceptance grows about
    linearly per doubling of the tree, as the DDTree paper's budget plot shows); 1 at budget 0
    (no speculation commits the target's own token).  A budget outside the curve's range is
    refused: an extrapolated acceptance would be a guess."""
    if budget == 0:
        return 1.0
    budgets = [b for b, _ in curve]
    if not budgets or not budgets[0] <= budget <= budgets[-1]:
        raise ValueError(f"budget {budget} is outside the simulated acceptance curve's budgets "
                         f"{budgets}")
    for (b0, t0), (b1, t1) in zip(curve, curve[1:]):
        if b0 <= budget <= b1:
            x = math.log2(budget / b0) / math.log2(b1 / b0)
            return t0 + x * (t1 - t0)
    return curve[0][1]  # a curve of one point, at this budget


@dataclass(frozen=True)
class SimulatedAcceptance:
    """A benchmark's forced acceptance: the mean commit length of a step at each budget
    (`tau(budget)`; SGLang draws each step's length around it) and SGLang's token mode
    ("fixed": every committed token is one id; "real-draft-token": the path's tokens)."""

    tau: Callable[[int], float]
    token_mode: str
