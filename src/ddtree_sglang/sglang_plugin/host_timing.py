"""Host time of each decode step, by stage (SGLANG_DDTREE_DEBUG=host_timing): does the host keep
the GPU waiting?

A step's GPU time and its wall time can differ: the GPU may wait for the host to launch the
next kernels.  With overlap scheduling the GPU waits only when the host's work for a step (the
scheduler's share between steps plus the worker's launches) takes longer than the GPU's.  This
clock reads the host's wall time alone (no device synchronisation, nothing changes on the GPU
side) and logs the mean per stage every `every` steps, beside the mean time between the end of
one step and the start of the next (the scheduler's share; a gap with no request running counts
there too, so read it under steady load).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

logger = logging.getLogger(__name__)


class StageClock:
    """start(bs) at a decode step's entry, mark(stage) after each stage, end() at its exit;
    means are kept per batch size, one log line per `every` steps of a batch size."""

    def __init__(self, every: int = 256, clock: Callable[[], float] = time.perf_counter,
                 log: Callable[[str], None] = logger.info) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every, self._clock, self._log = every, clock, log
        self._sums: dict[int, dict[str, float]] = {}
        self._steps: dict[int, int] = {}
        self._between: dict[int, float] = {}
        self._bs = 0
        self._last = self._ended = None

    def start(self, bs: int) -> None:
        now = self._clock()
        self._bs = bs
        if self._ended is not None:
            self._between[bs] = self._between.get(bs, 0.0) + (now - self._ended)
        self._last = now

    def mark(self, stage: str) -> None:
        now = self._clock()
        sums = self._sums.setdefault(self._bs, {})
        sums[stage] = sums.get(stage, 0.0) + (now - self._last)
        self._last = now

    def end(self) -> None:
        self.mark("rest")
        self._ended = self._last
        bs = self._bs
        self._steps[bs] = self._steps.get(bs, 0) + 1
        if self._steps[bs] == self.every:
            self._log(self.summary(bs))
            del self._sums[bs], self._steps[bs]
            self._between.pop(bs, None)

    def summary(self, bs: int) -> str:
        """Batch size `bs`'s means so far, ms per step: every stage, the worker's total, and
        the time between the previous step's end and this one's start."""
        n = max(self._steps.get(bs, 0), 1)
        sums = self._sums.get(bs, {})
        worker = sum(sums.values()) / n * 1e3
        stages = ", ".join(f"{k} {v / n * 1e3:.3f}" for k, v in sums.items())
        return (f"DDTREE host ms per decode step at batch size {bs} over "
                f"{self._steps.get(bs, 0)} steps: {stages}; worker {worker:.3f}, between steps "
                f"{self._between.get(bs, 0.0) / n * 1e3:.3f}")


class NoClock:
    """The default: the same calls, doing nothing."""

    def start(self, bs: int) -> None:
        pass

    def mark(self, stage: str) -> None:
        pass

    def end(self) -> None:
        pass
