"""benchmarks/step_host.py's count (bench/step_host.py) at batch 1: a decode step's Python calls,
builtin calls and aten ops, DDTREE's and DFLASH's, are the same run to run and no more than the
committed baseline holds (a ratchet: a change that adds host work to the step fails here, naming
where it grew).  Nothing is timed."""
import json
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from ddtree_bench.step_host import VARIANTS, measure_variant  # noqa: E402

RESULTS = "benchmarks/results/step_host_cpu_2026-12-07c"
BASELINE = Path(__file__).resolve().parents[1] / RESULTS / "step_host.json"
RERUN = f"python benchmarks/step_host.py --out {RESULTS}"
TOTALS = {"py_calls": "py_by_module", "c_calls": "c_by_module", "aten_ops": "ops_by_name",
          "stood_in_ops": None}  # per-step total -> its breakdown
COUNTS = (*TOTALS, "py_calls_range", "views", "py_by_module", "c_by_module", "ops_by_name",
          "top_functions", "top_c_calls")


@pytest.fixture(scope="module")
def baseline() -> dict[str, dict]:
    rows = json.loads(BASELINE.read_text())["rows"]
    return {r["variant"]: r for r in rows if r["bs"] == 1}


def counted(variant: str, base: dict) -> dict:
    """The variant's counts at batch 1, as the baseline's were taken (no timing)."""
    return measure_variant(variant, 1, steps=0, window=base["window"], settle=base["settle"])


@pytest.fixture(scope="module")
def first(baseline) -> dict[str, dict]:
    return {v: counted(v, baseline[v]) for v in VARIANTS}


def test_the_counts_are_the_same_run_to_run(first, baseline):
    for variant in VARIANTS:
        again = counted(variant, baseline[variant])
        assert {k: again[k] for k in COUNTS} == {k: first[variant][k] for k in COUNTS}, variant
    pinned = first["DDTREE pinned B=32"]  # the stages hold every op of the step
    assert sum(pinned["stage_ops"].values()) == pinned["aten_ops"] > 0


def growth(now: dict, base: dict) -> str:
    """The entries of a breakdown that grew, the most first."""
    grew = sorted(((now[k] - base.get(k, 0), k) for k in now if now[k] > base.get(k, 0)),
                  reverse=True)
    return ", ".join(f"{k} {base.get(k, 0):g} -> {now[k]:g}" for _, k in grew)


def test_the_counts_do_not_exceed_the_committed_baseline(first, baseline):
    problems = []
    for variant in VARIANTS:
        now, base = first[variant], baseline[variant]
        for total, by in TOTALS.items():
            if now[total] > base[total]:
                where = f"; grew: {growth(now[by], base[by])}" if by else ""
                problems.append(f"{variant}, batch 1: {total} per step {base[total]:g} -> "
                                f"{now[total]:g}{where}")
    assert not problems, (
        "the decode step's host work grew over the baseline (" + str(BASELINE.name) + " in "
        + RESULTS + "):\n  " + "\n  ".join(problems) + "\nIf the growth is intended, re-run `"
        + RERUN + "` and commit its output.")
