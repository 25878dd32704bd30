import torch

from ddtree_sglang.graphed import GraphedFunction
from ddtree_sglang.draft_tree_builder import build_draft_tree


def test_falls_back_to_eager_on_cpu():
    calls = []

    def fn(x):
        calls.append(1)
        t = build_draft_tree(x, 8)
        return t.tokens, t.parents

    g = GraphedFunction(fn, "test")
    x = torch.randn(2, 5, 11)
    a = g(x)
    b = fn(x)
    assert all(torch.equal(p, q) for p, q in zip(a, b)) and len(calls) == 2
    assert g._graphs == {}  # nothing captured off the GPU
