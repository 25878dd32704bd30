"""The worker's batch-aware budget (budget.BudgetController through its SGLang glue,
sglang_plugin/serving_budget.py), on the CPU: the host choice follows what the GPU-side
statistics learned, against the brute-force optimum."""
import pytest
import torch

pytest.importorskip("sglang", reason="the budget controller's SGLang side imports SGLang")

from ddtree_sglang.budget.controller import BudgetController, LiveStepCosts  # noqa: E402
from ddtree_sglang.sglang_plugin.serving_budget import (ServingBudget,  # noqa: E402
                                                         LaggedHostCopy, StepTimer, _HostMark,
                                                         verify_costs)

BUDGETS = [7, 15, 32]
DEPTH = 4


def depth_probs(bs: int, per_budget: list[float]) -> torch.Tensor:
    """[bs, K, D] predictions whose per-request total for budget k is per_budget[k]."""
    p = torch.tensor(per_budget).view(1, -1, 1).expand(bs, -1, DEPTH) / DEPTH
    return p.contiguous()


def controller(costs: LiveStepCosts, **options) -> ServingBudget:
    runtimes = {b + 1: (f"backend{b}", f"graphs{b}") for b in BUDGETS}
    return ServingBudget(BudgetController(BUDGETS, costs, DEPTH, **options), runtimes)


def make(costs: dict) -> ServingBudget:
    return controller(LiveStepCosts(costs), expected_decay=0.5)


def brute_force(bs: int, expected: list[float], ms: list[float]) -> int:
    rates = [bs * (e + 1) / c for e, c in zip(expected, ms)]
    return BUDGETS[rates.index(max(rates))]


def test_first_steps_use_the_configured_budget_then_the_best_rate():
    costs = {1: {7: 8.0, 15: 8.2, 32: 8.6}, 64: {7: 40.0, 15: 60.0, 32: 110.0}}
    ab = make(costs)
    assert ab.choose(1) == 32 and ab.choose(64) == 32  # nothing learned yet
    expected = [2.0, 3.0, 3.5]
    for bs in (1, 64):  # a perfectly calibrated drafter: observed = predicted
        ab.observe(bs, 32, depth_probs(bs, expected),
                   torch.full((bs,), 5, dtype=torch.int32))
    learned = ab._lagged.latest()
    for bs in (1, 64):
        want = brute_force(bs, learned.tolist(), [costs[bs][b] + ab.controller.costs.rest_ms.get(bs, 0.0)
                                                 for b in BUDGETS])
        assert ab.choose(bs) == want
    assert ab.choose(1) == 32 and ab.choose(64) == 7  # wide tree alone, small tree under load
    assert ab.controller.steps == {7: 0, 15: 0, 32: 2}


def test_calibration_lowers_an_overconfident_drafter():
    ab = make({8: {7: 10.0, 15: 10.5, 32: 11.0}})
    for _ in range(30):  # the drafter promises 4 tokens at every depth, requests accept 0
        ab.observe(8, 32, depth_probs(8, [4.0, 4.0, 4.0]),  # untimed: the table decides
                   torch.ones(8, dtype=torch.int32))
    assert float(ab._lagged.latest().max()) < 0.05
    assert ab.choose(8) == 7  # nothing is accepted: the cheapest verify wins


def test_lagged_copy_and_timer_on_the_cpu():
    lag = LaggedHostCopy((2,), torch.float32)
    assert lag.latest() is None
    lag.push(torch.tensor([1.0, 2.0]))
    assert lag.latest().tolist() == [1.0, 2.0]
    timer = StepTimer()
    timer.start(("a",))
    assert timer.finished() == []  # a step is timed when the next one starts
    timer.start(("b",))
    done = timer.finished()
    assert [k for k, _ in done] == [("a",)] and done[0][1] >= 0.0 and timer.finished() == []


def test_step_time_is_start_to_next_start_and_other_work_breaks_it(monkeypatch):
    """A step costs the period until the next decode step starts (host waits included); an
    interval with a prefill in it is no step's cost."""
    clock = iter([0.0, 0.005, 0.009, 0.020, 0.022]).__next__
    monkeypatch.setattr(_HostMark, "__init__", lambda self: setattr(self, "t", clock()))
    timer = StepTimer()
    timer.cuda = False
    timer.start((8, 32))   # t = 0
    timer.start((8, 7))    # t = 5 ms: step (8, 32) took 5 ms
    timer.start((8, 32))   # t = 9 ms: step (8, 7) took 4 ms
    timer.interrupt()      # a prefill runs
    timer.start((9, 32))   # t = 20 ms: not a step interval
    timer.start((9, 32))   # t = 22 ms
    got = [(k, round(ms, 6)) for k, ms in timer.finished()]
    assert got == [((8, 32), 5.0), ((8, 7), 4.0), ((9, 32), 2.0)]


def test_startup_costs_need_every_width_timed():
    runtimes = {8: ("b", "r8"), 33: ("b", "r33")}
    timed = {"r8": {1: 5.0, 8: 6.0}, "r33": {1: 5.5, 8: 9.0}}
    costs = verify_costs(runtimes, timed.get)
    assert costs.table == {1: {7: 5.0, 32: 5.5}, 8: {7: 6.0, 32: 9.0}}
    assert verify_costs(runtimes, {"r8": {1: 5.0}}.get) is None
    assert verify_costs({8: ("b", None)}, timed.get) is None


def test_statistics_are_updated_on_every_nth_step_only():
    ab = controller(LiveStepCosts({8: {7: 1.0, 15: 1.0, 32: 1.0}}), expected_decay=0.5,
                  stats_every=3)
    ones = torch.full((8,), 5, dtype=torch.int32)  # every request accepts 4 draft tokens
    ab.observe(8, 32, depth_probs(8, [1.0, 2.0, 3.0]), ones)  # the first: kept
    first = ab._lagged.latest().clone()
    ab.observe(8, 32, depth_probs(8, [0.0, 0.0, 0.0]), ones)  # skipped
    assert torch.equal(ab._lagged.latest(), first)
    ab.observe(8, 32, depth_probs(8, [0.0, 0.0, 0.0]), ones)  # 3rd: kept
    assert not torch.equal(ab._lagged.latest(), first)
    assert ab.controller.steps[32] == 3  # every step is counted and timed


def test_exploration_measures_every_candidate():
    ab = controller(LiveStepCosts({8: {7: 1.0, 15: 1.1, 32: 1.2}}), explore_every=4)
    ab.observe(8, 32, depth_probs(8, [0.5, 1.0, 3.0]),
               torch.full((8,), 4, dtype=torch.int32))
    picks = [ab.choose(8) for _ in range(12)]
    assert picks[3] == 7 and picks[7] == 7  # never chosen on merit, so the least measured
    assert [p for i, p in enumerate(picks) if i % 4 != 3] == [32] * 9


def test_exploration_refreshes_the_stalest_cell_once_windows_are_full():
    """Full windows tie on count: exploring the least recently measured budget keeps every
    cell fresh (ties going to the smallest budget left a wide budget's early, slow samples
    in place for good on the H200 testbed run of 2026-12-05)."""
    costs = LiveStepCosts({8: {7: 1.0, 15: 1.1, 32: 1.2}}, window=2, min_samples=1,
                          skip_first=0)
    for b in (32, 7, 15, 7, 15, 32):
        costs.observe(8, b, 3.0)
    assert costs.least_sampled(8, BUDGETS) == 7  # all full: 7 was measured longest ago
    costs.observe(8, 7, 3.0)
    assert costs.least_sampled(8, BUDGETS) == 15
    costs.observe(8, 15, 3.0)
    assert costs.least_sampled(8, BUDGETS) == 32


def test_exploration_can_be_turned_off():
    ab = controller(LiveStepCosts({8: {7: 1.0, 15: 1.1, 32: 1.2}}), explore_every=0)
    ab.observe(8, 32, depth_probs(8, [0.5, 1.0, 3.0]),
               torch.full((8,), 4, dtype=torch.int32))
    assert [ab.choose(8) for _ in range(40)] == [32] * 40


def gated(costs: dict, min_gain: float = 0.03, explore_every: int = 4) -> ServingBudget:
    return controller(LiveStepCosts(costs, window=5, min_samples=1, skip_first=0),
                    expected_decay=0.5, explore_every=explore_every, min_gain=min_gain)


def test_a_host_bound_batch_size_verifies_the_largest_budget_with_no_choice(caplog):
    """Verify graphs 0.03 ms apart in a 4.4 ms step (the testbed at batch 1 on an H100): no
    smaller tree can gain 3%, so every step is the largest budget's, exploration included,
    and no statistics run (the same work as a pinned budget)."""
    ab = gated({1: {7: 0.11, 15: 0.12, 32: 0.14}})
    assert not ab.controller.engaged(1)  # no step timed yet: the period is unknown, the largest budget
    ab.controller.costs.observe(1, 32, 4.4)  # one live step: the period is known
    caplog.set_level("INFO")
    picks = [ab.choose(1) for _ in range(16)]
    for _ in range(4):  # the drafter would make B=7 look best if the choice ran
        ab.observe(1, 32, depth_probs(1, [3.0, 3.0, 3.0]), torch.full((1,), 4, dtype=torch.int32))
    picks += [ab.choose(1) for _ in range(16)]
    assert picks == [32] * 32
    assert ab._lagged.latest() is None  # no statistics were gathered
    assert ab.controller.steps == {7: 0, 15: 0, 32: 4}
    assert sum("verifies the largest budget" in r.message for r in caplog.records) == 1


def test_the_choice_engages_where_the_tree_size_costs_time_and_stops_where_it_does_not():
    ab = gated({8: {7: 2.0, 15: 3.0, 32: 6.0}})
    ab.controller.costs.observe(8, 32, 8.0)  # 4 ms of 8 could be saved: the choice matters
    ab.observe(8, 32, depth_probs(8, [1.0, 1.1, 1.2]), torch.full((8,), 2, dtype=torch.int32))
    assert ab.controller.engaged(8) and ab.choose(8) == 7
    for _ in range(5):  # the host becomes the bottleneck: a 400 ms period
        ab.controller.costs.observe(8, 32, 400.0)
    assert not ab.controller.engaged(8) and ab.choose(8) == 32


def test_an_engaged_choice_does_not_flip_on_gains_below_the_margin():
    """Two budgets within 1% of each other: the first choice stays while estimates move by
    less than min_gain (live medians move by more than that between steps)."""
    ab = gated({8: {7: 5.0, 15: 5.05, 32: 9.0}}, explore_every=0)
    ab.controller.costs.observe(8, 32, 12.0)  # rest 3 ms: B=7 8 ms, B=15 8.05 ms, B=32 12 ms
    ab.observe(8, 32, depth_probs(8, [1.0, 1.02, 1.3]), torch.full((8,), 2, dtype=torch.int32))
    expected = ab._lagged.latest().tolist()
    assert ab.choose(8) == brute_force(8, expected, [8.0, 8.05, 12.0]) == 15
    ab.controller.costs.observe(8, 7, 8.0)
    ab.controller.costs.observe(8, 15, 8.1)  # live: now B=7 is 0.4% better than B=15
    assert brute_force(8, expected, ab.controller.costs.row_ms(8, BUDGETS)) == 7
    assert ab.choose(8) == 15
    for _ in range(5):
        ab.controller.costs.observe(8, 15, 9.0)  # B=15 now costs 9 ms: B=7 is 11% better
    assert ab.choose(8) == 7


def test_min_gain_zero_is_the_ungated_choice():
    ab = gated({1: {7: 0.11, 15: 0.12, 32: 0.14}}, min_gain=0.0, explore_every=0)
    ab.controller.costs.observe(1, 32, 4.4)
    ab.observe(1, 32, depth_probs(1, [3.0, 3.0, 3.0]), torch.full((1,), 4, dtype=torch.int32))
    assert ab.controller.engaged(1) and ab.choose(1) == 7  # equal acceptance: the cheapest verify


def test_served_steps_on_a_host_bound_batch_never_leave_the_largest_budget(monkeypatch):
    """choose -> start_step -> observe as the worker calls them, on a clock where every step
    takes 4.4 ms and the verifies differ by 0.03 ms: from the first step on, B = 32 only, and
    no statistics."""
    ticks = iter(i * 0.0044 for i in range(1000)).__next__
    monkeypatch.setattr(_HostMark, "__init__", lambda self: setattr(self, "t", ticks()))
    ab = gated({4: {7: 0.11, 15: 0.12, 32: 0.14}}, explore_every=2)
    ab._timer.cuda = False
    picks = []
    for _ in range(40):
        budget = ab.choose(4)
        ab.start_step(4, budget)
        ab.observe(4, budget, depth_probs(4, [3.0, 3.0, 3.0]), torch.full((4,), 4, dtype=torch.int32))
        picks.append(budget)
    assert picks == [32] * 40 and ab._lagged.latest() is None
    assert ab.controller.costs.row_ms(4, [32]) == [pytest.approx(4.4)]
    assert not ab.controller.engaged(4)


def test_a_lane_without_the_gate_chooses_once_a_period_is_known():
    costs = LiveStepCosts({4: {7: 5.0, 15: 5.01, 32: 5.02}})  # verify times nearly equal
    gated = BudgetController(BUDGETS, costs, DEPTH, min_gain=0.03)
    open_ = BudgetController(BUDGETS, costs, DEPTH, min_gain=0.03, gate=False)
    assert not open_.engaged(4)  # no live step timed yet
    costs.observe(4, 32, 9.0)
    costs.observe(4, 32, 9.0)
    assert not gated.engaged(4) and open_.engaged(4)
