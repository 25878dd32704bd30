"""The batch-aware budget chooser (budget.py) against brute force."""
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_sglang.tree.acceptance import accept_tree
from ddtree_sglang.budget.controller import (DepthCalibration, LiveStepCosts, candidate_budgets,
                                  choose_budget, expected_by_depth_per_request,
                                  largest_budget_gain_bound)
from ddtree_sglang.tree.builder import build_draft_tree


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
    by_depth = expected_by_depth_per_request(tree.scores, tree.depths, budgets, depth).sum(0)
    for i, b in enumerate(budgets):
        assert by_depth[i].sum().item() == pytest.approx(exact_expected_accept(logits, b), abs=1e-5)
    # more nodes never lower the expectation, and no depth exceeds one request
    assert torch.all(by_depth.sum(-1).diff() >= 0) and by_depth.max() <= 1 + 1e-6


def test_expected_by_depth_sums_over_the_batch_and_checks_the_width():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.05, 0.01]]))
    depths = torch.tensor([[1, 2, 1], [1, 2, 3]])
    out = expected_by_depth_per_request(scores, depths, [1, 3], max_depth=3).sum(0)
    assert torch.allclose(out, torch.tensor([[1.4, 0.0, 0.0], [1.6, 0.35, 0.01]]), atol=1e-6)
    with pytest.raises(ValueError, match="budgets up to 4"):
        expected_by_depth_per_request(scores, depths, [4], max_depth=3)


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


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.lists(st.tuples(st.floats(0, 40), st.floats(0.5, 200)),
                                    min_size=1, max_size=8),
       st.data(), st.floats(0, 0.2))
def test_a_current_budget_is_kept_unless_another_gains_more_than_the_margin(batch, table, data,
                                                                            min_gain):
    current = data.draw(st.integers(0, len(table) - 1))
    rates = [(a + batch) / c for a, c in table]
    i = choose_budget(batch, [a for a, _ in table], [c for _, c in table], current, min_gain)
    best = max(rates)
    if best > rates[current] * (1 + min_gain):  # worth a switch: the brute-force optimum
        assert rates[i] == best and rates.index(best) == i
    else:  # not worth one: stay, and lose at most the margin
        assert i == current and rates[i] * (1 + min_gain) >= best


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0.01, 50), min_size=1, max_size=7), st.floats(0.0, 200),
       st.integers(1, 64), st.data())
def test_no_smaller_tree_beats_the_largest_by_more_than_the_bound(verify, rest, batch, data):
    """Brute force over acceptance that only grows with the budget (as the builder's nested
    trees guarantee) and steps that differ only in their verify time."""
    verify = sorted(verify)[::-1] if data.draw(st.booleans()) else verify  # any order of costs
    accepted = sorted(data.draw(st.lists(st.floats(0, 16 * batch), min_size=len(verify),
                                         max_size=len(verify))))
    period = rest + verify[-1]
    bound = largest_budget_gain_bound(verify, period)
    rates = [(a + batch) / (rest + v) for a, v in zip(accepted, verify)]
    assert max(rates) <= rates[-1] * (1 + bound) * (1 + 1e-9)


def test_gain_bound_of_a_host_bound_step_and_of_unknown_costs():
    # the testbed on an H100 at batch 1: verify graphs 0.11-0.14 ms, a 4.4 ms step
    assert largest_budget_gain_bound([0.11, 0.12, 0.13, 0.14], 4.4) == pytest.approx(0.03 / 4.37)
    assert largest_budget_gain_bound([1.0, 2.0, float("inf")], 9.0) == float("inf")
    assert largest_budget_gain_bound([1.0, float("inf"), 2.0], 9.0) == pytest.approx(1 / 8)
    assert largest_budget_gain_bound([1.0, 3.0], 2.0) == float("inf")  # period below the saving


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


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), big=st.integers(2, 40), depth=st.integers(1, 5))
def test_truncating_the_largest_tree_gives_every_smaller_budgets_tree(seed, big, depth):
    from ddtree_sglang.tree.builder import count_prefixes, truncate_tree

    big = min(big, count_prefixes(depth, 12, big))  # a depth-1 draft has only 12 prefixes

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, depth, 12, generator=g) * 3
    tree = build_draft_tree(logits, big)
    for b in range(1, big + 1):
        cut, built = truncate_tree(tree, b), build_draft_tree(logits, b)
        for name in ("tokens", "parents", "depths"):
            assert torch.equal(getattr(cut, name), getattr(built, name)), (b, name)
        assert torch.allclose(cut.scores, built.scores)
    with pytest.raises(ValueError, match=f"0..{big}"):
        truncate_tree(tree, big + 1)
    root_only = truncate_tree(tree, 0)  # no draft: the root alone
    assert root_only.tokens.shape == (2, 0) and root_only.budget == 0


def test_step_costs_lookup_and_checks():
    from ddtree_sglang.budget.controller import StepCosts

    costs = StepCosts({1: {15: 8.0, 31: 8.5}, 8: {15: 11.0}})
    assert costs.row_ms(1, [15, 31]) == [8.0, 8.5]
    assert costs.row_ms(4, [15, 31]) == [11.0, float("inf")]  # next larger batch
    assert costs.row_ms(64, [15]) == [11.0]                   # beyond: the largest
    with pytest.raises(ValueError, match="positive"):
        StepCosts({1: {15: 0.0}})
    with pytest.raises(ValueError, match="at least one"):
        StepCosts({})


def choose_for(ctl, tree) -> tuple[int, torch.Tensor]:
    """The controller's budget for `tree` (built with its largest budget) from the tree's own
    predictions, as the reference loop chooses; and those predictions."""
    probs = expected_by_depth_per_request(tree.scores, tree.depths, ctl.budgets,
                                          ctl.calibration.ratio.numel())
    return ctl.choose(tree.batch_size, ctl.calibrated(probs).tolist()), probs


def test_controller_prefers_wide_trees_when_cheap_and_narrow_when_not():
    from ddtree_sglang.budget.controller import BudgetController, StepCosts

    g = torch.Generator().manual_seed(1)
    tree = build_draft_tree(torch.randn(4, 6, 50, generator=g), 32)
    flat = BudgetController([4, 16, 32], StepCosts({4: {4: 10.0, 16: 10.0, 32: 10.0}}), 6)
    steep = BudgetController([4, 16, 32], StepCosts({4: {4: 10.0, 16: 40.0, 32: 80.0}}), 6)
    assert choose_for(flat, tree)[0] == 32 and choose_for(steep, tree)[0] == 4
    assert flat.choose(4, None) == 32  # nothing known: the largest
    with pytest.raises(ValueError, match="ascending"):
        BudgetController([16, 4], StepCosts({1: {4: 1.0}}), 6)
    with pytest.raises(ValueError, match="explore_every"):
        BudgetController([4], StepCosts({1: {4: 1.0}}), 6, explore_every=-1)


def test_controller_learns_that_the_target_rejects_deep_tokens():
    """A target that never accepts beyond depth 1 makes wide trees worthless: once calibrated,
    the controller picks the smallest budget even where the drafter alone would go wide."""
    from ddtree_sglang.budget.controller import BudgetController, StepCosts

    logits = torch.zeros(2, 6, 50)
    logits[:, :, 0] = 6.0  # a confident drafter: deep prefixes look likely
    tree = build_draft_tree(logits, 16)
    ctl = BudgetController([2, 16], StepCosts({2: {2: 10.0, 16: 13.0}}), 6, decay=0.5)
    assert choose_for(ctl, tree)[0] == 16
    for _ in range(20):
        budget, probs = choose_for(ctl, tree)
        ctl.observe(2, budget, probs, torch.tensor([1, 1]))
    assert choose_for(ctl, tree)[0] == 2
    assert ctl.steps[16] >= 1


def test_per_request_expectation_sums_to_the_batch_one():
    g = torch.Generator().manual_seed(1)
    tree = build_draft_tree(torch.randn(3, 4, 6, generator=g) * 2, 10)
    per = expected_by_depth_per_request(tree.scores, tree.depths, [2, 5, 10], 4)
    assert per.shape == (3, 3, 4)
    for r in range(3):  # each request's rows are its own tree's, whatever the batch
        alone = expected_by_depth_per_request(tree.scores[r:r + 1], tree.depths[r:r + 1],
                                              [2, 5, 10], 4)
        assert torch.allclose(per[r], alone[0])
    assert per.sum(-1).max() <= 4 + 1e-6  # at most one accepted token per depth


def test_candidate_budgets_end_with_the_maximum():
    assert candidate_budgets(32) == [7, 15, 32]
    assert candidate_budgets(64) == [7, 15, 31, 64]
    assert candidate_budgets(15) == [7, 15]
    assert candidate_budgets(8) == [8]  # 7 is too close to 8 to be worth its graphs


def test_live_costs_add_the_learned_rest_of_a_step_to_every_budget():
    costs = LiveStepCosts({8: {7: 10.0, 32: 20.0}, 64: {7: 30.0, 32: 90.0}}, window=3,
                          min_samples=3, skip_first=0)
    assert costs.row_ms(5, [7, 32]) == [10.0, 20.0]
    costs.observe(5, 32, 26.0)  # a step at batch row 8 took 6 ms more than its verify
    assert costs.row_ms(8, [7, 32]) == [16.0, 26.0]
    costs.observe(8, 7, 12.0)   # median of 6 and 2
    assert costs.row_ms(8, [7, 32]) == [14.0, 24.0]
    costs.observe(8, 7, 90.0)   # a one-time spike (80 ms more) does not move the median
    assert costs.rest_ms[8] == 6.0
    # a row without live steps borrows the nearest row's remainder
    assert costs.row_ms(64, [7, 32]) == [36.0, 96.0]
    costs.observe(64, 7, 31.0)
    assert costs.row_ms(64, [7, 32]) == [31.0, 91.0]  # then learns its own
    costs.observe(8, 15, 99.0)  # a budget without a verify time teaches nothing
    assert costs.rest_ms[8] == 6.0


def test_live_cells_replace_the_model_once_sampled():
    """A cell measured min_samples times costs what it measured (its median), whatever the
    startup table said: real contexts make wide verifies dearer than the capture-time table."""
    costs = LiveStepCosts({8: {7: 10.0, 32: 11.0}}, window=5, min_samples=3, skip_first=0)
    for ms in (30.0, 31.0, 29.0):  # B = 32 really costs ~30 ms; its table said 11
        costs.observe(8, 32, ms)
    rest = costs.rest_ms[8]  # 19: charged to B = 7 too, which has no live steps yet
    assert rest == 19.0
    assert costs.row_ms(8, [7, 32]) == [29.0, 30.0]
    assert costs.least_sampled(8, [7, 32]) == 7 and costs.least_sampled(8, [7, 15, 32]) == 7
    for ms in (14.0, 15.0, 16.0):  # B = 7 measured: 15 ms, not the modelled 29
        costs.observe(8, 7, ms)
    assert costs.row_ms(8, [7, 32]) == [15.0, 30.0]
    with pytest.raises(ValueError, match="min_samples"):
        LiveStepCosts({8: {7: 1.0}}, window=2, min_samples=3)
    with pytest.raises(ValueError, match="skip_first"):
        LiveStepCosts({8: {7: 1.0}}, skip_first=-1)


def test_first_live_step_of_each_cell_is_not_counted():
    """The H200 e2e run 5 timed one first step at 106,872 ms (host work while other servers
    started); counted, it made that batch size's remainder absurd until 15 more steps came."""
    costs = LiveStepCosts({24: {15: 0.125, 32: 0.25}}, window=15, min_samples=1)
    costs.observe(24, 15, 106_872.0)
    assert costs.rest_ms == {} and costs.row_ms(24, [15, 32]) == [0.125, 0.25]
    costs.observe(24, 15, 8.125)
    assert costs.row_ms(24, [15, 32]) == [8.125, 8.25]
    costs.observe(24, 32, 500.0)  # the first step of each cell, not only of each row
    assert costs.row_ms(24, [15, 32]) == [8.125, 8.25]


def test_no_speculation_is_chosen_by_measured_tokens_per_ms_and_never_on_a_guess():
    """Budget 0 commits one token a request per step: it wins where its measured period is
    short enough against a tree step's tokens; before its own cell is measured it costs a tree
    step's remainder (never chosen on a guess); its steps stay out of the tree steps'
    remainder; with it among the candidates every batch size chooses (the verify-time gate
    cannot see the draft it saves)."""
    from ddtree_sglang.budget.controller import BudgetController, LiveStepCosts

    costs = LiveStepCosts({8: {0: 1.0, 15: 2.0}}, min_samples=2, skip_first=0)
    ctl = BudgetController([0, 15], costs, 6, min_gain=0.03)
    assert not ctl.engaged(8)  # no period known yet
    for _ in range(3):
        costs.observe(8, 15, 10.0)  # tree steps: 10 ms, remainder 8 ms
    assert costs.rest_ms[8] == 8.0 and ctl.engaged(8)
    assert costs.row_ms(8, [0, 15]) == [9.0, 10.0]  # 0 unmeasured: verify 1 + tree remainder
    # 8 requests x (1 + 0.2 accepted) / 10 ms = 0.96 < 8 / 9 ms? no: 0.89; the tree wins
    assert ctl.choose(8, [0.0, 0.2]) == 15
    for _ in range(2):
        costs.observe(8, 0, 4.0)  # measured: plain steps of 4 ms
    assert costs.rest_ms[8] == 8.0  # untouched by the 0-steps
    assert ctl.choose(8, [0.0, 0.2]) == 0  # 2.0 tokens/ms against 0.96
    assert ctl.choose(8, [0.0, 5.0]) == 15  # a tree accepting 5 a request wins again
    assert ctl.observe(8, 0, None, None) is None and ctl.steps[0] == 1
