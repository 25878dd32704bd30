"""benchmarks/step_host.py's measurement (bench/step_host.py): the real decode step over stood-in
models runs, its stages are timed, and the ops outside the graphed stages are counted."""
import pytest

pytest.importorskip("sglang")


def test_the_step_runs_over_stand_ins_and_its_ops_are_counted():
    from ddtree_bench.step_host import measure

    pinned = measure(1, 32, (32,), steps=3, warmup=1)
    aware = measure(1, 32, (7, 15, 32), steps=3, warmup=1)
    stages = {"draft + tree", "verify", "sample + accept", "commit", "rest"}
    assert set(pinned["stages_us"]) == stages and pinned["host_us"] > 0
    assert 0 < pinned["ops"] < aware["ops"]  # the budget controller's statistics cost ops
    assert sum(pinned["stage_ops"].values()) == pinned["ops"]
