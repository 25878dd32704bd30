"""The evidence plan (bench/evidence.py, benchmarks/evidence.py): which slices a call runs next,
how committed slices combine (ratios inside a slice only), the report and its refusals.  The
serving itself needs a GPU; here slice results are synthetic."""

import json
import sys
from pathlib import Path

import pytest

from ddtree_bench import evidence
from ddtree_bench.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import evidence as evidence_cli  # noqa: E402

PLAN = """
slices_per_cell: 2
seconds: 4
rounds: 2
arms:
  plain: {}
  dflash: {algorithm: DFLASH}
  ddtree-auto: {algorithm: DDTREE, env: {SGLANG_DDTREE_GRAMMAR: auto}}
slices:
  - {id: g-json, item: 1, what: json, arms: [plain, dflash, ddtree-auto], kinds: [json, none],
     concurrency: [1, 16]}
  - {id: verdict, item: 2, what: v, arms: [plain, dflash, ddtree-auto], concurrency: [1, 64],
     seconds: 8}
  - {id: e2e, item: 4, what: e2e, phase: e2e, phase_seconds: 400}
"""


def write_plan(tmp_path: Path, text: str = PLAN) -> Path:
    p = tmp_path / "plan.yaml"
    p.write_text(text)
    return p


def row(arm, kind, conc, rounds, accept=None):
    return dict(arm=arm, kind=kind, concurrency=conc, rounds_tok_s=rounds,
                output_tok_s=sorted(rounds)[len(rounds) // 2], accept_length=accept)


def slice_result(sid, device, rows, arms=("plain", "dflash", "ddtree-auto"), failures=None):
    return dict(meta=dict(slice=sid, device=device, date="2026-12-07", arms=list(arms),
                          phase=None), rows=rows, failures=failures or {})


def commit(results: Path, res: dict, name: str) -> None:
    folder = results / res["meta"]["slice"] / name
    folder.mkdir(parents=True)
    (folder / evidence.RESULT_FILE).write_text(json.dumps(res))


def json_cells(conc, dd=(110, 120), df=(100, 100), pl=(90, 100)):
    return [row("plain", "json", conc, list(pl)), row("dflash", "json", conc, list(df), 3.0),
            row("ddtree-auto", "json", conc, list(dd), 4.0),
            row("plain", "none", conc, [200, 200]), row("dflash", "none", conc, [150, 150], 3.5),
            row("ddtree-auto", "none", conc, [160, 160], 4.5)]


def test_the_plan_is_read_and_bad_plans_are_refused_naming_the_problem(tmp_path):
    plan = evidence.load_plan(write_plan(tmp_path))
    assert [s.id for s in plan.slices] == ["g-json", "verdict", "e2e"]
    assert plan.arms["ddtree-auto"].env == {"SGLANG_DDTREE_GRAMMAR": "auto"}
    bad = {
        "unknown arm(s) ddtree-x": PLAN.replace("[plain, dflash, ddtree-auto], kinds",
                                                "[plain, ddtree-x], kinds"),
        "unknown grammar kind(s) jsn": PLAN.replace("kinds: [json, none]", "kinds: [jsn]"),
        "needs the arm 'plain'": PLAN.replace("[plain, dflash, ddtree-auto], concurrency",
                                              "[dflash, ddtree-auto], concurrency"),
        "SGLANG_DDTREE_GRAMMAR": PLAN.replace("GRAMMAR: auto", "GRAMMAR: fast"),
        "a phase slice takes no arms": PLAN.replace("phase: e2e,", "phase: e2e, arms: [plain],"),
        "unknown key": PLAN.replace("rounds: 2", "rounds: 2\nround: 3"),
        "not valid YAML": PLAN.replace("slices:", "slices: {"),
    }
    for needle, text in bad.items():
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            evidence.load_plan(write_plan(tmp_path, text))
    with pytest.raises(ConfigError, match="not found"):
        evidence.load_plan(tmp_path / "missing.yaml")


def test_the_next_call_runs_what_lacks_results_and_continues_where_the_last_stopped(tmp_path):
    plan = evidence.load_plan(write_plan(tmp_path))
    results = tmp_path / "results"
    todo = evidence.next_slices(plan, evidence.counts(evidence.read_slices(results)))
    assert [(s.id, lv) for s, lv in todo] == [("g-json", [1, 16]), ("verdict", [1, 64]),
                                              ("e2e", [0])]
    # a slice cut short after c = 1: only c = 16 is still short of its first result
    commit(results, slice_result("g-json", "NVIDIA H100 80GB HBM3", json_cells(1)), "a")
    todo = evidence.next_slices(plan, evidence.counts(evidence.read_slices(results)))
    assert todo[0][0].id == "g-json" and todo[0][1] == [1, 16]  # c = 1 has 1 of 2
    commit(results, slice_result("g-json", "NVIDIA H200", json_cells(1) + json_cells(16)), "b")
    commit(results, slice_result("g-json", "NVIDIA H100 80GB HBM3", json_cells(16)), "c")
    todo = evidence.next_slices(plan, evidence.counts(evidence.read_slices(results)))
    assert [s.id for s, _ in todo] == ["verdict", "e2e"]  # every g-json cell has 2
    # a cell where an arm is missing (its server failed) does not count
    commit(results, slice_result("verdict", "H100", [
        row("plain", "none", 1, [1, 1]), row("dflash", "none", 1, [1, 1])],
        failures={"ddtree-auto": "startup failed"}), "a")
    assert evidence.next_slices(plan, evidence.counts(evidence.read_slices(results)))[0][1] \
        == [1, 64]
    # a phase counts once it passed
    e2e = dict(meta=dict(slice="e2e", phase="e2e", device="H100", date="d", arms=[]), rc=1)
    commit(results, e2e, "a")
    commit(results, dict(e2e, rc=0), "b")
    commit(results, dict(e2e, rc=0), "c")
    assert [s.id for s, _ in evidence.next_slices(
        plan, evidence.counts(evidence.read_slices(results)))] == ["verdict"]


def test_slices_combine_through_their_own_ratios_never_absolute_rates(tmp_path):
    plan = evidence.load_plan(write_plan(tmp_path))
    results = tmp_path / "results"
    # two cards, very different absolute rates, the same ratios inside each slice
    commit(results, slice_result("g-json", "NVIDIA H100", json_cells(1)), "a")
    commit(results, slice_result("g-json", "NVIDIA H200", json_cells(
        1, dd=(330, 390), df=(300, 300), pl=(270, 300))), "b")
    cells = {(e["kind"], e["arm"]): e for e in evidence.combined_cells(
        plan, evidence.read_slices(results))}
    auto = cells[("json", "ddtree-auto")]
    # per slice: median of paired round ratios (110/100, 120/100) = 1.15; (1.1, 1.3) = 1.2
    assert auto["x_dflash"] == [1.15, 1.2]
    assert auto["x_plain"] == [1.211, 1.261]  # (110/90, 120/100); (330/270, 390/300)
    # the tax: the median round's tok/s with the grammar / without, same slice's servers
    assert auto["tax"] == [0.75, 2.438] and auto["tax_dflash"] == [0.667, 2.0]
    assert auto["accept"] == [4.0, 4.0] and auto["accept_dflash"] == [3.0, 3.0]
    assert auto["cards"] == ["NVIDIA H100", "NVIDIA H200"]
    assert cells[("none", "ddtree-auto")]["tax"] == []  # no tax without a grammar
    md = evidence.report_markdown(plan, evidence.read_slices(results))
    line = next(x for x in md.splitlines() if x.startswith("| g-json | json | 1 | ddtree-auto"))
    assert "| 1.17 [1.15-1.20] | 1.24 [1.21-1.26] |" in line and "| 2 | H100, H200 |" in line
    assert "[1](g-json/a/) [2](g-json/b/)" in line
    assert "Pending (2 results per cell wanted): g-json (item 1) at c = 16; verdict" in md
    png = evidence.plot(plan, evidence.read_slices(results), tmp_path / "e.png")
    assert png and png.stat().st_size > 1000


def test_estimates_stamps_and_the_serving_config(tmp_path):
    plan = evidence.load_plan(write_plan(tmp_path))
    g, v, e2e = plan.slices
    # 3 arms x 2 rounds x (4 s + 1.5 s) per cell, 2 kinds x 2 levels, + startup 200
    assert evidence.estimate_seconds(plan, g, [1, 16]) == pytest.approx(200 + 33 * 4)
    assert evidence.estimate_seconds(plan, e2e, [0]) == 400
    cfg = evidence.slice_config(plan, v, ROOT, [64])
    assert cfg.concurrency == [64] and cfg.min_cell_seconds == 8 and cfg.repeats == 2
    assert cfg.interleave and cfg.warmup_per_cell and cfg.startup_group == 3
    assert [a.name for a in cfg.arms] == ["plain", "dflash", "ddtree-auto"]
    assert evidence.stamp("2026-12-07", "NVIDIA H100 80GB HBM3", []) == "2026-12-07_h10080gbhbm3_1"
    assert evidence.stamp("2026-12-07", "NVIDIA H200", ["2026-12-07_h200_1"]) == \
        "2026-12-07_h200_2"


def test_adopt_files_returned_slices_and_refuses_to_overwrite(tmp_path, capsys):
    plan_path = write_plan(tmp_path)
    returned = tmp_path / "out"
    commit(returned, slice_result("g-json", "NVIDIA H100", json_cells(1)), "2026-12-07_h100_1")
    results = tmp_path / "results"
    args = ["--plan", str(plan_path), "--results", str(results)]
    assert evidence_cli.main(args + ["adopt", str(returned)]) == 0
    assert (results / "g-json" / "2026-12-07_h100_1" / "slice.json").is_file()
    assert "| g-json | json | 1 | ddtree-auto" in (results / "README.md").read_text()
    assert evidence_cli.main(args + ["adopt", str(returned)]) == 2
    assert "exists already" in capsys.readouterr().err
    assert evidence_cli.main(args + ["adopt", str(tmp_path / "empty")]) == 2
    assert evidence_cli.main(args + ["next"]) == 0
    assert "g-json (item 1, c = 1, 16)" in capsys.readouterr().out
    assert evidence_cli.main(args + ["run", "--out", str(tmp_path / "o"), "--only", "g-jsn"]) == 2
    assert "--only: unknown slice(s) g-jsn; accepted: g-json, verdict, e2e" in \
        capsys.readouterr().err


def test_the_shipped_plan_is_valid_and_every_phase_exists_in_gpu_run():
    plan = evidence.load_plan(ROOT / "configs" / "evidence.yaml")
    script = (ROOT / "scripts" / "gpu_run.sh").read_text()
    for s in plan.slices:
        if s.phase:
            assert f"\n  {s.phase})" in script
        else:  # every serving slice's first level fits one call with a cold start
            assert evidence.estimate_seconds(plan, s, s.concurrency[:1]) < plan.call_seconds
    assert "evidence)" in script


def test_a_call_runs_the_next_slice_against_stand_in_servers(tmp_path, monkeypatch, capsys):
    """The runner end to end with the stand-in server (tests/fake_sglang_server.py): a call
    without the time for a slice's first level starts nothing; one with time runs every level,
    writes slice.json / slice.md / logs.tgz; adopted, the next call's list starts past it."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'tests'}:{ROOT / 'src'}")
    plan_path = write_plan(tmp_path, PLAN.replace("rounds: 2", "rounds: 1").replace(
        "arms: [plain, dflash, ddtree-auto], kinds", "arms: [plain, ddtree-auto], kinds").replace(
        "\nseconds: 4\n", "\nseconds: 0.3\nstartup_seconds: 5"
                                                  "\nlauncher_module: fake_sglang_server\n"))
    results, out = tmp_path / "results", tmp_path / "out"
    args = ["--plan", str(plan_path), "--results", str(results)]
    # a level of g-json needs ~5 + 2 kinds x 2 arms x 1 round x 1.8 s: not in 8 s
    assert evidence_cli.main(args + ["run", "--out", str(out), "--seconds", "8",
                                     "--only", "g-json"]) == 0
    assert "skip g-json" in capsys.readouterr().out and not out.exists()
    assert evidence_cli.main(args + ["run", "--out", str(out), "--seconds", "300",
                                     "--only", "g-json"]) == 0
    folder = next((out / "g-json").iterdir())
    res = json.loads((folder / "slice.json").read_text())
    assert evidence.cells_of(res) == {("json", 1), ("none", 1), ("json", 16), ("none", 16)}
    assert res["cells_skipped"] == [] and res["failures"] == {}
    assert res["greedy_vs_plain"]["json"]["ddtree-auto"]["identical"] > 0
    assert sorted(p.name for p in folder.iterdir()) == ["logs.tgz", "slice.json", "slice.md"]
    assert "evidence call: 1 slice(s)" in capsys.readouterr().out
    assert evidence_cli.main(args + ["adopt", str(out)]) == 0
    capsys.readouterr()
    assert evidence_cli.main(args + ["next"]) == 0
    assert "g-json (item 1, c = 1, 16)" in capsys.readouterr().out  # 1 of 2 results per cell


def test_a_slice_past_its_deadline_starts_no_cell(tmp_path, monkeypatch):
    """measure_slice checks each cell's estimate (arms x rounds x (seconds + 1.5 s)) against
    the deadline before starting it, and names the cells it left out."""
    import time

    from ddtree_bench import slices

    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'tests'}:{ROOT / 'src'}")
    plan = evidence.load_plan(write_plan(tmp_path, PLAN + "launcher_module: fake_sglang_server\n"))
    cfg = evidence.slice_config(plan, plan.slices[0], ROOT)
    assert slices.cell_seconds(cfg, 3) == pytest.approx(3 * 2 * 5.5)
    results = dict(rows=[], greedy_vs_plain={}, failures={})
    slices.measure_slice(cfg, ["json", "none"], tmp_path, results, lambda: None,
                         stop_at=time.monotonic() + 10)  # < one cell's 33 s
    assert results["rows"] == [] and results["failures"] == {}
    assert results["cells_skipped"] == [dict(kind=k, concurrency=c) for c in (1, 16)
                                        for k in ("json", "none")]
