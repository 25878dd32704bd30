"""The batch-aware budget chooser (budget.py) against brute force."""
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_sglang.acceptance import accept_tree
from ddtree_sglang.budget import DepthCalibration, choose_budget, expected_by_depth
from ddtree_sglang.tree import build_draft_tree


def exact_expected_accept(logits: torch.Tensor, budget: int) -> float:
    """Enumerate every target continuation drawn from the drafter's own marginals and walk the
    tree: the exact expected number of accepted draft tokens."""
    depth, vocab = logits.shape
    q = torch.softmax(logits.double(), -1)
    tree = build_draft_tree(logits[None], budget)
    n = budget + 1
    tokens = torch.cat([torch.zeros(1, 1, dtype=torch.long), tree.tokens], 1)  # root first
    parents = torch.cat([torch.full((1, 1), -1), tree.parents.clamp(min=-1) + 1], 1)
    depths = torch.cat([torch.zeros(1, 1, dtype=torch.long), tree.depths], 1)
    total = 0.0
    for seq in itertools.product(range(vocab), repeat=depth):
        p = float(torch.prod(q[torch.arange(depth), torch.tensor(seq)]))
        # the target's choice at a node of depth d is seq[d] (independent of the path)
        choice = torch.tensor([[seq[min(int(d), depth - 1)] for d in depths[0]]])
        acc = accept_tree(tokens, parents, depths, choice, max_depth=depth)
        total += p * int(acc.accept_len[0] - 1)  # accept_len counts the bonus
    assert n == tokens.shape[1]
    return total


@pytest.mark.parametrize("seed", range(4))
def test_sum_of_prefix_probabilities_is_the_expected_acceptance(seed):
    g = torch.Generator().manual_seed(seed)
    depth, vocab = 3, 4
    logits = torch.randn(depth, vocab, generator=g) * 2
    budgets = [1, 3, 6, 10]
    tree = build_draft_tree(logits[None], max(budgets))
    by_depth = expected_by_depth(tree.scores, tree.depths, budgets, depth)
    for i, b in enumerate(budgets):
        assert by_depth[i].sum().item() == pytest.approx(exact_expected_accept(logits, b), abs=1e-5)
    # more nodes never lower the expectation, and no depth exceeds one request
    assert torch.all(by_depth.sum(-1).diff() >= 0) and by_depth.max() <= 1 + 1e-6


def test_expected_by_depth_sums_over_the_batch_and_checks_the_width():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.05, 0.01]]))
    depths = torch.tensor([[1, 2, 1], [1, 2, 3]])
    out = expected_by_depth(scores, depths, [1, 3], max_depth=3)
    assert torch.allclose(out, torch.tensor([[1.4, 0.0, 0.0], [1.6, 0.35, 0.01]]), atol=1e-6)
    with pytest.raises(ValueError, match="budgets up to 4"):
        expected_by_depth(scores, depths, [4], max_depth=3)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.lists(st.tuples(st.floats(0, 40), st.floats(0.5, 200)),
                                    min_size=1, max_size=8))
def test_choice_is_the_brute_force_optimum(batch, table):
    acc = torch.tensor([a for a, _ in table], dtype=torch.float64)
    ms = torch.tensor([c for _, c in table], dtype=torch.float64)
    rates = [(a + batch) / c for a, c in table]
    best = max(rates)
    i = int(choose_budget(batch, acc, ms))
    assert rates[i] == best and rates.index(best) == i  # the first (smallest) on ties


def test_unavailable_budgets_are_never_chosen():
    i = choose_budget(8, torch.tensor([5.0, 50.0]), torch.tensor([10.0, float("inf")]))
    assert int(i) == 0


def test_calibration_learns_per_depth_ratios():
    cal = DepthCalibration(max_depth=3, decay=0.5)
    predicted = torch.tensor([4.0, 2.0, 1.0])  # 4 requests: expected >= 1, >= 2, >= 3 accepted
    for _ in range(40):  # observed: 4 accept >= 1, 1 accepts >= 2, none >= 3
        cal.update(predicted, torch.tensor([1, 2, 1, 1]))
    assert torch.allclose(cal.ratio, torch.tensor([1.0, 0.5, 0.0]), atol=1e-6)
    assert cal.corrected(predicted).item() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="decay"):
        DepthCalibration(3, decay=1.0)
