"""The SGLang side of the batch-aware tree budget (budget/controller.py has the logic).

Per step the worker calls:
  * `choose(bs)` on the host, before the draft: the controller's choice from the batch size,
    the step costs and the drafter's calibrated expected acceptance as of an earlier step (a
    non-blocking copy, `LaggedHostCopy`: nothing waits for the GPU);
  * `runtimes[width]`: the target attention backend and verify CUDA graphs for that width,
    built at startup per candidate (patches.build_verify_runtime);
  * `observe(...)` after the acceptance walk, on the GPU: the controller's statistics, whose
    result is copied back for a later step's choice;
  * `start_step` / `interrupt`: step timing with CUDA events from one decode step's start to
    the next's (the period that sets throughput, host waits included), read back once
    completed: it refines the costs.

Costs: the verify pass of every (captured batch size, candidate width) is timed at startup by
replaying its graph; what the rest of a step costs is learned per batch size from live steps
(budget/controller.LiveStepCosts).
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from ddtree_sglang.budget.controller import BudgetController, LiveStepCosts
from ddtree_sglang.sglang_plugin import patches, sglang_api as sg
from ddtree_sglang.sglang_plugin.settings import EXPLORE_EVERY, MIN_GAIN

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


class ServingBudget:
    """The SGLang side of the batch-aware budget (one per worker): a budget.BudgetController
    fed with CUDA step timings and read back without waiting, plus the target verify runtime
    (attention backend, CUDA graphs) of every candidate width."""

    def __init__(self, controller: BudgetController, runtimes: dict[int, tuple]) -> None:
        self.controller = controller
        self.runtimes = runtimes  # verify width -> (attention backend, graph runner)
        self._lagged = LaggedHostCopy((len(controller.budgets),), torch.float32)
        self._lagged_src: torch.Tensor | None = None  # the copy `_expected` came from
        self._expected: list[float] | None = None
        self._timer = StepTimer()

    def expected(self) -> list[float] | None:
        """The newest landed copy of the per-request expected acceptance, as host floats
        (converted once per copy, not once per step)."""
        value = self._lagged.latest()
        if value is not None and value is not self._lagged_src:
            self._lagged_src, self._expected = value, value.tolist()
        return None if value is None else self._expected

    def choose(self, bs: int) -> int:
        """The budget for a decode batch of `bs` requests (host only; no GPU wait)."""
        for (batch, budget), ms in self._timer.finished():
            self.controller.costs.observe(batch, budget, ms)
        return self.controller.choose(bs, self.expected())

    def start_step(self, bs: int, budget: int) -> None:
        """A decode step of `bs` requests verifying `budget` starts (times the one before)."""
        self._timer.start((bs, budget))

    def interrupt(self) -> None:
        """A forward other than a decode step runs (prefill, idle): not part of a step."""
        self._timer.interrupt()

    def observe(self, bs: int, budget: int, depth_probs: torch.Tensor,
                commit_lens: torch.Tensor) -> None:
        """After the acceptance walk (GPU work only).  depth_probs [bs, K, D]: the tree stage's
        predicted acceptance per candidate and depth (None after a step without a draft);
        commit_lens [bs]: accepted + bonus."""
        if budget == 0:  # no draft: nothing predicted, nothing to learn
            self.controller.observe(bs, 0, None, None)
            return
        expected = self.controller.observe(bs, budget, depth_probs, commit_lens.long() - 1)
        if expected is not None:
            self._lagged.push(expected)


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


def build_serving_budget(runner, budgets: list[int], depth: int, device, prepare_backend=None,
                         log: bool = True, explore_every: int = EXPLORE_EVERY,
                         min_gain: float = MIN_GAIN) -> ServingBudget | None:
    """A target verify (attention backend + CUDA graphs) per candidate width of the target's
    model `runner`, each timed; or None, with a warning (every step then verifies the largest
    budget), where that cannot be: CUDA graphs off, graphs that cannot be timed, no memory."""
    largest = budgets[-1]
    runtimes = {largest + 1: sg.verify_runtime(runner)}
    if runtimes[largest + 1][1] is None or not torch.cuda.is_available():
        logger.warning("DDTREE: the batch-aware budget needs the target's verify CUDA graphs "
                       "(off here); every step verifies B=%d", largest)
        return None
    free_before = torch.cuda.mem_get_info()[0] / 2**30
    try:
        for budget in budgets[:-1]:
            runtimes[budget + 1] = patches.build_verify_runtime(runner, budget + 1,
                                                                  prepare_backend)
        costs = verify_costs(runtimes, sg.time_verify_graphs)
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
                    "%.3g, verify graphs built for %d more widths (%.2f GiB); verify ms "
                    "at startup by batch size: %s", budgets, min_gain,
                    len(budgets) - 1, free_before - torch.cuda.mem_get_info()[0] / 2**30,
                    {bs: {b: round(ms, 2) for b, ms in row.items()}
                     for bs, row in costs.table.items()})
    controller = BudgetController(budgets, costs, depth, device, min_gain=min_gain,
                                  explore_every=explore_every, stats_every=4, log=log)
    return ServingBudget(controller, runtimes)
