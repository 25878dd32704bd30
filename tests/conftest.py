import math

import torch

from ddtree_sglang.reference.heap import heap_tree as reference_heap_tree


def heap_tree(log_probs: torch.Tensor, budget: int):
    """(score, tokens-tuple) of the paper's heap, in pop order (reference/heap.py)."""
    return [(n.score, n.tokens) for n in reference_heap_tree(log_probs, budget)]


def node_prefixes(tokens, parents):
    """Token tuple of every node of one tree (tokens/parents as lists)."""
    pref = []
    for t, p in zip(tokens, parents):
        pref.append((pref[p] if p >= 0 else ()) + (t,))
    return pref


def near(a: float, b: float, tol: float = 1e-4) -> bool:
    return math.isclose(a, b, abs_tol=tol)


def server_args(**fields):
    """A stand-in for SGLang's ServerArgs: every field DDTREE reads, None unless given."""
    from types import SimpleNamespace

    from ddtree_sglang.sglang_plugin.server_args import READ_FIELDS

    return SimpleNamespace(**{**dict.fromkeys(READ_FIELDS), **fields})
