import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import heap_tree, node_prefixes
from ddtree_sglang.tree.builder import build_draft_tree, chain_tree, check_budget


@pytest.mark.parametrize("batch,depth,vocab,budget", [
    (1, 1, 5, 3), (1, 3, 5, 6), (2, 15, 50, 16), (3, 15, 300, 64), (2, 7, 8, 100),
    (4, 15, 1000, 128), (1, 2, 3, 12), (2, 15, 64, 256),
])
def test_matches_heap(batch, depth, vocab, budget):
    g = torch.Generator().manual_seed(batch * 1000 + depth * 10 + budget)
    logits = torch.randn(batch, depth, vocab, generator=g) * 3
    tree = build_draft_tree(logits, budget)
    lp = torch.log_softmax(logits.double(), -1)
    for b in range(batch):
        ref = heap_tree(lp[b], budget)
        ours = node_prefixes(tree.tokens[b].tolist(), tree.parents[b].tolist())
        assert len(set(ours)) == budget
        assert set(ours) == {p for _, p in ref}, "node set differs from the heap"
        # Best-first order: the scores are the heap's scores in the heap's order.
        assert torch.allclose(tree.scores[b].double(),
                              torch.tensor([s for s, _ in ref], dtype=torch.float64), atol=1e-4)
        assert tree.depths[b].tolist() == [len(p) for p in ours]


def test_worked_example_from_reference():
    # ddtree_dflash.md section 1.3: B = 6 over three depths of four tokens.
    logits = torch.tensor([[3, 2, 0, -1], [2.5, 2.4, 0, -1], [4, 0, 0, 0]], dtype=torch.float)[None]
    tree = build_draft_tree(logits, 6)
    assert tree.tokens[0].tolist() == [0, 0, 0, 1, 0, 1]
    assert tree.depths[0].tolist() == [1, 2, 3, 2, 3, 1]
    assert tree.parents[0].tolist() == [-1, 0, 1, 0, 3, -1]


def test_ties_are_deterministic_and_prefix_closed():
    logits = torch.zeros(2, 4, 6)  # every prefix of a depth ties with its siblings
    a = build_draft_tree(logits, 20)
    b = build_draft_tree(logits.clone(), 20)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    # Uniform marginals: all 6 depth-1 nodes beat any depth-2 node, and ties go to low ranks.
    assert a.depths[0].tolist()[:6] == [1] * 6
    assert a.depths[0].tolist()[6:] == [2] * 14


def test_chain_tree_is_argmax_chain():
    logits = torch.randn(3, 15, 40)
    tree = chain_tree(logits)
    assert torch.equal(tree.tokens, logits.argmax(-1))
    assert tree.parents[0].tolist() == list(range(-1, 14))


def test_budget_errors():
    with pytest.raises(ValueError, match="accepted: 1..6"):
        check_budget(7, 2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        build_draft_tree(torch.randn(1, 3, 4), 0)


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 3), depth=st.integers(1, 8), vocab=st.integers(2, 30),
       budget=st.integers(1, 80), seed=st.integers(0, 10_000),
       scale=st.sampled_from([0.1, 1.0, 5.0]))
def test_tree_properties(batch, depth, vocab, budget, seed, scale):
    from ddtree_sglang.tree.builder import count_prefixes

    budget = min(budget, count_prefixes(depth, vocab, budget))
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, depth, vocab, generator=g) * scale).round(decimals=1)
    tree = build_draft_tree(logits, budget)
    assert tree.tokens.shape == (batch, budget)
    for b in range(batch):
        par, dep = tree.parents[b].tolist(), tree.depths[b].tolist()
        for i, p in enumerate(par):
            assert p < i  # parent first
            assert dep[i] == (1 if p < 0 else dep[p] + 1)
        prefixes = node_prefixes(tree.tokens[b].tolist(), par)
        assert len(set(prefixes)) == budget  # distinct: sibling tokens never collide
        s = tree.scores[b]
        assert bool((s[1:] <= s[:-1] + 1e-6).all())  # best-first
        # Optimal: no prefix outside the tree scores better than the worst node in it.
        lp = torch.log_softmax(logits[b].double(), -1)
        ref = heap_tree(lp, budget)
        assert abs(sum(x for x, _ in ref) - float(s.double().sum())) < 1e-3
