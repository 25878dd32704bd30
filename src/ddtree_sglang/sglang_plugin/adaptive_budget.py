"""The batch-aware tree budget in the SGLang worker: per decode batch, verify the tree cut to
the candidate budget that commits the most tokens per millisecond (budget.py has the why).

What the worker gets from here, per step:
  * `choose(bs)` on the host, before the draft: the budget for this batch, from the batch size,
    the step-cost table and the drafter's calibrated expected acceptance as of an earlier step
    (a non-blocking copy, `LaggedHostCopy`: nothing waits for the GPU);
  * `runtime(width)`: the target attention backend and verify CUDA graphs for that width,
    built at startup per candidate (internals.build_verify_runtime);
  * `observe(...)` after the acceptance walk, on the GPU: the calibration learns observed over
    predicted acceptance, and the per-request expected acceptance of every candidate is
    refreshed for a later step's choice;
  * step timing with CUDA events from one decode step's start to the next's (the period that
    sets throughput, host waits included), read back once completed: it refines the costs.

Costs: the verify pass of every (captured batch size, candidate width) is timed at startup by
replaying its graph; what the rest of a step costs is learned per batch size from live steps,
and a budget measured live a few times at a batch size costs what it measured
(budget.LiveStepCosts); one step in `explore_every` per batch size tries the least-measured
budget so that every candidate gets measured.

The gate: a smaller tree can beat the largest only by the verify time it saves, so where that
saving is under `min_gain` of the batch size's step period (a host-bound server: verifies
0.01-0.2 ms apart in 4-17 ms steps), the batch size verifies the largest budget with no
choice, statistics or exploration, the same work as a pinned budget (`engaged`).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from ddtree_sglang.budget import (DepthCalibration, LiveStepCosts, choose_budget,
                                  largest_budget_gain_bound)
from ddtree_sglang.sglang_plugin import internals
from ddtree_sglang.sglang_plugin.server_args import MIN_GAIN_ENV

logger = logging.getLogger(__name__)


class LaggedHostCopy:
    """The most recent completed host copy of a small GPU tensor, read without waiting.

    push() starts a non-blocking copy into pinned memory unless the previous one is still in
    flight; latest() returns the newest copy that has landed (None before the first).  A CPU
    tensor is copied at once (tests)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._host = torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())
        self._value: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

    def _harvest(self) -> bool:
        if self._event is None:
            return True
        if not self._event.query():
            return False
        self._value = self._host.clone()
        self._event = None
        return True

    def push(self, x: torch.Tensor) -> None:
        if not self._harvest():
            return
        if not x.is_cuda:
            self._value = x.detach().clone()
            return
        self._host.copy_(x, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def latest(self) -> torch.Tensor | None:
        self._harvest()
        return self._value


class _HostMark:
    """A CPU stand-in for a timing CUDA event (the worker on a CPU-only test machine)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_HostMark") -> float:
        return (end.t - self.t) * 1e3


class StepTimer:
    """What a decode step really costs: the GPU time from its start to the next decode step's
    start (CUDA events, read back once the GPU has run them; no waiting).

    That interval holds the step's own kernels and whatever the GPU then waited for the host
    to launch the next step, so it is the period that sets throughput whether the GPU or the
    host is the bottleneck.  (Timing a step's kernels alone missed the host: on the testbed
    pair a decode iteration took 5-13 ms while its kernels took 2.5, so budgets that differ
    by a fraction of a millisecond on the GPU looked 5-10% apart when the host made them equal.)
    An interval with other GPU work in it (a prefill, an idle batch) is dropped: `interrupt()`
    ends the chain.  Host clocks where there is no GPU (tests)."""

    def __init__(self, max_pending: int = 256) -> None:
        self._pending: deque = deque()
        self.max_pending = max_pending
        self.cuda = torch.cuda.is_available()
        self._open: tuple | None = None  # (key, mark) of the last step started

    def _mark(self):
        if not self.cuda:
            return _HostMark()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, key: tuple) -> None:
        """A decode step of `key` starts: the previous one (if its chain is unbroken) ends."""
        mark = self._mark()
        if self._open is not None and len(self._pending) < self.max_pending:
            self._pending.append((*self._open, mark))
        self._open = (key, mark)

    def interrupt(self) -> None:
        """Other GPU work runs before the next decode step: the open interval is not a step."""
        self._open = None

    def finished(self) -> list[tuple[tuple, float]]:
        done = []
        while self._pending and self._pending[0][2].query():
            key, start, end = self._pending.popleft()
            done.append((key, start.elapsed_time(end)))
        return done


class AdaptiveBudget:
    """Host-side choice + GPU-side statistics of the batch-aware budget (one per worker)."""

    def __init__(self, budgets: list[int], max_depth: int, runtimes: dict[int, tuple],
                 costs: LiveStepCosts, device, decay: float = 0.9, stats_every: int = 4,
                 explore_every: int = 32, min_gain: float = 0.0) -> None:
        self.budgets = list(budgets)
        # Predicted gains below min_gain are not acted on: a batch size where no smaller tree
        # can gain that much verifies the largest budget with no choice, statistics or
        # exploration (the same work as a pinned budget), and a chosen budget is replaced
        # only by one promising that much more.
        self.min_gain = min_gain
        self._gate: dict[int, tuple[int, bool]] = {}  # cost row -> (costs.version, engaged)
        self._announced: dict[int, bool] = {}  # cost row -> the judgement last logged
        # One step in explore_every (0: none) of a batch size verifies its least-measured
        # budget, so every candidate's live cost is known (lossless either way; at most that share of
        # steps runs a budget the model does not prefer).
        self.explore_every = explore_every
        self._row_steps: dict[int, int] = {}
        # The acceptance statistics are ~25 small launches; they move slowly, so every
        # stats_every-th step's tree and acceptance are enough (a subsample, not a bias).
        self.stats_every = stats_every
        self._observed = 0
        self.runtimes = runtimes  # verify width -> (attention backend, graph runner)
        self.costs = costs
        self.decay = decay
        self.calibration = DepthCalibration(max_depth, device=device)
        self._expected = torch.zeros(len(budgets), device=device)  # per request, EMA
        self._seen = False
        self._lagged = LaggedHostCopy((len(budgets),), torch.float32)
        self._expected_src: torch.Tensor | None = None  # the copy _expected_host came from
        self._expected_host: list[float] = []
        self._timer = StepTimer()
        self._last_choice: dict[int, int] = {}  # cost row -> budget, for the log
        self.steps = dict.fromkeys(self.budgets, 0)

    def choose(self, bs: int) -> int:
        """The budget for a decode batch of `bs` requests (host only; no GPU wait)."""
        for (batch, budget), ms in self._timer.finished():
            self.costs.observe(batch, budget, ms)
        row = self.costs.batch_row(bs)
        largest = self.budgets[-1]
        if not self.engaged(bs, row):
            return largest
        expected = self._expected_per_request()
        if expected is None:  # nothing learned yet: the configured (largest) budget
            return largest
        self._row_steps[row] = self._row_steps.get(row, 0) + 1
        if self.explore_every and self._row_steps[row] % self.explore_every == 0:
            return self.costs.least_sampled(bs, self.budgets)
        step_ms = self.costs.row_ms(bs, self.budgets)
        current = self.budgets.index(self._last_choice.get(row, largest))
        budget = self.budgets[choose_budget(bs, [e * bs for e in expected], step_ms,
                                            current, self.min_gain)]
        if self._last_choice.get(row, largest) != budget:
            self._last_choice[row] = budget
            logger.info("DDTREE budget: batch size %d -> B=%d (expected accepted per request "
                        "%s, step ms %s over budgets %s)", bs, budget,
                        [round(x, 2) for x in expected], [round(x, 2) for x in step_ms],
                        self.budgets)
        return budget

    def engaged(self, bs: int, row: int | None = None) -> bool:
        """Whether the choice can matter at this batch size: some smaller candidate could gain
        at least min_gain over the largest (budget.largest_budget_gain_bound, from the startup
        verify times and the row's step period as measured so far; before any live step is
        timed, no: the largest budget).  Re-judged only when a cost changed; a change is
        logged."""
        row = self.costs.batch_row(bs) if row is None else row
        version = self.costs.version
        cached = self._gate.get(row)
        if cached is not None and cached[0] == version:
            return cached[1]
        if self.min_gain > 0 and not self.costs.rest_ms:  # no step period measured yet
            self._gate[row] = (version, False)
            return False
        verify = self.costs.verify_ms(bs, self.budgets)
        period = self.costs.row_ms(bs, self.budgets[-1:])[0]
        bound = largest_budget_gain_bound(verify, period)
        engaged = bound >= self.min_gain
        if self._announced.get(row) != engaged:
            self._announced[row] = engaged
            logger.info("DDTREE budget: batch size %d %s: a smaller tree can gain at most "
                        "%.1f%% over B=%d (verify ms %s at startup, step %.2f ms; %s=%.3g)",
                        bs, "chooses per step" if engaged else "verifies the largest budget",
                        100 * bound, self.budgets[-1], [round(x, 3) for x in verify], period,
                        MIN_GAIN_ENV, self.min_gain)
            if not engaged:
                self._last_choice.pop(row, None)
        self._gate[row] = (version, engaged)
        return engaged

    def _expected_per_request(self) -> list[float] | None:
        """The newest landed copy of the per-request expected acceptance, as host floats
        (converted once per copy, not once per step)."""
        value = self._lagged.latest()
        if value is not None and value is not self._expected_src:
            self._expected_src, self._expected_host = value, value.tolist()
        return None if value is None else self._expected_host

    def start_step(self, bs: int, budget: int) -> None:
        """A decode step of `bs` requests verifying `budget` starts (times the one before)."""
        self._timer.start((bs, budget))

    def interrupt(self) -> None:
        """A forward other than a decode step runs (prefill, idle): not part of a step."""
        self._timer.interrupt()

    def observe(self, bs: int, budget: int, depth_probs: torch.Tensor,
                commit_lens: torch.Tensor) -> None:
        """After the acceptance walk (GPU work only).  depth_probs [bs, K, D]: the tree stage's
        predicted acceptance per candidate and depth; commit_lens [bs]: accepted + bonus."""
        self.steps[budget] += 1
        cached = self._gate.get(self.costs.batch_row(bs))
        if cached is not None and not cached[1]:  # no choice at this batch size: no statistics
            return
        self._observed += 1
        if self._observed % self.stats_every and self._seen:
            return
        predicted = depth_probs.sum(0)  # [K, D]
        k = self.budgets.index(budget)
        self.calibration.update(predicted[k], commit_lens.long() - 1)
        per_request = self.calibration.corrected(predicted) / bs  # [K]
        if self._seen:
            self._expected.mul_(self.decay).add_(per_request, alpha=1 - self.decay)
        else:
            self._expected.copy_(per_request)
            self._seen = True
        self._lagged.push(self._expected)


def verify_costs(runtimes: dict[int, tuple], time_graphs) -> LiveStepCosts | None:
    """The startup cost table {batch size: {budget: verify ms}} from timing every width's
    captured verify graphs (`time_graphs(runner)` -> {bs: ms} or None); None if any width has
    no timable graphs."""
    table: dict[int, dict[int, float]] = {}
    for width, (_, runner) in runtimes.items():
        timed = time_graphs(runner) if runner is not None else None
        if not timed:
            return None
        for bs, ms in timed.items():
            table.setdefault(bs, {})[width - 1] = ms
    return LiveStepCosts(table)


def build_adaptive_budget(runner, budgets: list[int], depth: int, device, prepare_backend=None,
                          log: bool = True, explore_every: int = 32,
                          min_gain: float = 0.0) -> AdaptiveBudget | None:
    """A target verify (attention backend + CUDA graphs) per candidate width of the target's
    model `runner`, each timed; or None, with a warning (every step then verifies the largest
    budget), where that cannot be: CUDA graphs off, graphs that cannot be timed, no memory."""
    largest = budgets[-1]
    runtimes = {largest + 1: internals.verify_runtime(runner)}
    if runtimes[largest + 1][1] is None or not torch.cuda.is_available():
        logger.warning("DDTREE: the batch-aware budget needs the target's verify CUDA graphs "
                       "(off here); every step verifies B=%d", largest)
        return None
    free_before = torch.cuda.mem_get_info()[0] / 2**30
    try:
        for budget in budgets[:-1]:
            runtimes[budget + 1] = internals.build_verify_runtime(runner, budget + 1,
                                                                  prepare_backend)
        costs = verify_costs(runtimes, internals.time_verify_graphs)
    except Exception as exc:  # noqa: BLE001 - e.g. no memory left for more graphs
        logger.warning("DDTREE: the batch-aware budget could not build its narrower verifies "
                       "(%s: %s); every step verifies B=%d", type(exc).__name__,
                       str(exc)[:300], largest)
        return None
    if costs is None:
        logger.warning("DDTREE: the verify graphs could not be timed; every step verifies B=%d",
                       largest)
        return None
    if log:
        logger.info("DDTREE batch-aware budget: candidates %s, acting on predicted gains >= "
                    "%.3g (%s), verify graphs built for %d more widths (%.2f GiB); verify ms "
                    "at startup by batch size: %s", budgets, min_gain, MIN_GAIN_ENV,
                    len(budgets) - 1, free_before - torch.cuda.mem_get_info()[0] / 2**30,
                    {bs: {b: round(ms, 2) for b, ms in row.items()}
                     for bs, row in costs.table.items()})
    return AdaptiveBudget(budgets, depth, runtimes, costs, device,
                          explore_every=explore_every, min_gain=min_gain)
