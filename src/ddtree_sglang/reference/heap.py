"""The paper's best-first heap for one request, on the host: the oracle the batched builders
(`tree.builder.build_draft_tree`, the Triton kernel) are tested against, and the CPU baseline of
`benchmarks/tree_build.py`.

Candidates are rank tuples (r_1..r_d) over each position's top-K tokens; a popped prefix pushes
its next sibling (r_d + 1) and its first child (r_1..r_d, 0), so prefixes come out in order of
decreasing probability and every parent before its children.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeapNode:
    score: float                # log-probability of the prefix under the drafter
    tokens: tuple[int, ...]     # the prefix's token ids, depth = len(tokens)
    parent: int                 # index of the parent in pop order, -1 for depth 1


def heap_tree(log_probs: torch.Tensor, budget: int) -> list[HeapNode]:
    """log_probs [depth, vocab] of one request -> the `budget` best prefixes in pop order."""
    depth, vocab = log_probs.shape
    k = min(budget, vocab)
    top_lp, top_ids = torch.topk(log_probs.double(), k, dim=-1)
    lp, ids = top_lp.cpu().tolist(), top_ids.cpu().tolist()
    heap = [(-lp[0][0], (0,), -1)]
    nodes: list[HeapNode] = []
    while heap and len(nodes) < budget:
        neg, ranks, parent = heapq.heappop(heap)
        d, r = len(ranks), ranks[-1]
        nodes.append(HeapNode(-neg, tuple(ids[i][q] for i, q in enumerate(ranks)), parent))
        if r + 1 < k:
            heapq.heappush(heap, (neg + lp[d - 1][r] - lp[d - 1][r + 1], ranks[:-1] + (r + 1,),
                                  parent))
        if d < depth:
            heapq.heappush(heap, (neg - lp[d][0], ranks + (0,), len(nodes) - 1))
    return nodes
