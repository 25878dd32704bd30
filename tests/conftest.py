import heapq
import math

import torch


def heap_tree(log_probs: torch.Tensor, budget: int):
    """The paper's best-first heap over rank tuples (a straightforward restatement, float64).

    log_probs: [depth, vocab].  Returns a list of (score, tokens-tuple) in pop order.
    """
    lp = log_probs.double()
    depth, vocab = lp.shape
    k = min(budget, vocab)
    top_lp, top_ids = torch.topk(lp, k, dim=-1)
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    heap = [(-top_lp[0][0], (0,))]
    out = []
    while heap and len(out) < budget:
        neg, ranks = heapq.heappop(heap)
        d = len(ranks)
        out.append((-neg, tuple(top_ids[i][r] for i, r in enumerate(ranks))))
        r = ranks[-1]
        if r + 1 < k:
            heapq.heappush(heap, (neg + top_lp[d - 1][r] - top_lp[d - 1][r + 1], ranks[:-1] + (r + 1,)))
        if d < depth:
            heapq.heappush(heap, (neg - top_lp[d][0], ranks + (0,)))
    return out


def node_prefixes(tokens, parents):
    """Token tuple of every node of one tree (tokens/parents as lists)."""
    pref = []
    for t, p in zip(tokens, parents):
        pref.append((pref[p] if p >= 0 else ()) + (t,))
    return pref


def near(a: float, b: float, tol: float = 1e-4) -> bool:
    return math.isclose(a, b, abs_tol=tol)
