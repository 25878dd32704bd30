"""The draft tree's types: what a tree builder returns, the budgets it can fill, and the
PyTorch top-k of the draft positions every builder starts from.

A leaf module (PyTorch only): the PyTorch builder (tree/builder.py) and the fused Triton
builder (kernels/tree_build.py) both import it, and neither imports the other.
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


# (draft logits [batch, depth, vocab], k) -> the k best tokens of every position and their
# float32 log-probabilities, sorted descending, [batch, depth, k] each.
TopLogProbs = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def torch_top_log_probs(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The TopLogProbs of PyTorch: top-k on the raw logits (softmax preserves order), and only
    the k winners normalised by one float32 logsumexp per position, so no [batch, depth,
    vocab] float32 tensor is written."""
    values, ids = torch.topk(draft_logits, k, dim=-1)
    lse = torch.logsumexp(draft_logits.float(), dim=-1)
    return values.float() - lse.unsqueeze(-1), ids


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
