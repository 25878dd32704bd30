"""The host-time clock of the decode step (sglang_plugin/host_timing.py): stage sums, the
gap between steps, and one log line per `every` steps; with a fake clock, no GPU."""

from __future__ import annotations

import pytest

from ddtree_sglang.sglang_plugin.host_timing import NoClock, StageClock


def test_stage_clock_means_per_stage_and_between_steps():
    ticks = iter([0.000, 0.001, 0.004, 0.005,     # step 1: draft 1 ms, tree 3 ms, rest 1 ms
                  0.007, 0.008, 0.011, 0.012,     # 2 ms between steps, then the same again
                  0.013, 0.015, 0.016, 0.017])    # a step at another batch size: kept apart
    logged = []
    clock = StageClock(every=2, clock=lambda: next(ticks), log=logged.append)
    for bs in (1, 1, 8):
        clock.start(bs)
        clock.mark("draft")
        clock.mark("tree")
        clock.end()
    assert len(logged) == 1
    line = logged[0]
    assert "batch size 1 over 2 steps: draft 1.000, tree 3.000, rest 1.000" in line
    assert "worker 5.000, between steps 1.000" in line  # one 2 ms gap over 2 steps
    assert "over 0 steps" in clock.summary(1)            # reset after its log line
    assert "batch size 8 over 1 steps: draft 2.000, tree 1.000, rest 1.000" in clock.summary(8)
    assert "between steps 1.000" in clock.summary(8)     # 12 -> 13 ms


def test_stage_clock_rejects_a_bad_period_and_the_default_does_nothing():
    with pytest.raises(ValueError, match="every must be >= 1"):
        StageClock(every=0)
    off = NoClock()
    assert (off.start(1), off.mark("draft"), off.end()) == (None, None, None)
    assert vars(off) == {}  # it keeps nothing: no time is read, no state grows
