"""The evidence plan (bench/evidence.py, benchmarks/evidence.py): which slices a call runs next,
which committed cells count (a measured null within 5%), how counted slices combine (time ratios
inside a slice only), the report and its refusals.  The serving itself needs a GPU; here slice
results are synthetic, or measured against the stand-in server."""

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from ddtree_bench import evidence, run, slices
from ddtree_bench.config import ConfigError, load_config
from test_server_log import CRASH_LOG, ROOT_CAUSE

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import evidence as evidence_cli  # noqa: E402

PLAN = """
slices_per_cell: 2
seconds: 4
rounds: 2
null_arm: ddtree-auto
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
TWIN = "ddtree-auto-null"


def write_plan(tmp_path: Path, text: str = PLAN) -> Path:
    p = tmp_path / "plan.yaml"
    p.write_text(text)
    return p


def row(arm, kind, conc, rates, accept=None, tokens=1000.0):
    """A fixed-work row: every round served `tokens` output tokens at `rates` tok/s."""
    return dict(arm=arm, kind=kind, concurrency=conc, rounds_tok_s=list(rates),
                rounds_wall_s=[tokens / r for r in rates], requests=8,
                output_tok_s=sorted(rates)[len(rates) // 2], accept_length=accept)


def old_row(arm, kind, conc, rates, accept=None):
    """A row of the slices committed before fixed work and nulls: tok/s per round only."""
    return dict(arm=arm, kind=kind, concurrency=conc, rounds_tok_s=list(rates),
                output_tok_s=sorted(rates)[len(rates) // 2], accept_length=accept)


def slice_result(sid, device, rows, arms=("plain", "dflash", "ddtree-auto"), failures=None,
                 null="ddtree-auto"):
    meta = dict(slice=sid, device=device, date="2026-12-07", phase=None, commit="abc1234",
                arms=list(arms) + ([f"{null}-null"] if null else []))
    if null:
        meta["null"] = dict(arm=null, twin=f"{null}-null")
    return dict(meta=meta, rows=rows, failures=failures or {})


def commit(results: Path, res: dict, name: str) -> None:
    folder = results / res["meta"]["slice"] / name
    folder.mkdir(parents=True)
    (folder / evidence.RESULT_FILE).write_text(json.dumps(res))


def json_cells(conc, dd=(110, 120), df=(100, 100), pl=(90, 100), null=1.0):
    """One concurrency's json and none cells; the null's twin served `null` times slower."""
    return [row("plain", "json", conc, pl), row("dflash", "json", conc, df, 3.0),
            row("ddtree-auto", "json", conc, dd, 4.0),
            row(TWIN, "json", conc, [x / null for x in dd], 4.0),
            row("plain", "none", conc, [200, 200]), row("dflash", "none", conc, [150, 150], 3.5),
            row("ddtree-auto", "none", conc, [160, 160], 4.5),
            row(TWIN, "none", conc, [160, 160], 4.5)]


def pending(plan, results: Path) -> list[tuple[str, list[int]]]:
    return [(s.id, lv) for s, lv in evidence.next_slices(
        plan, evidence.counts(evidence.read_slices(results)))]


def test_the_plan_is_read_and_bad_plans_are_refused_naming_the_problem(tmp_path):
    plan = evidence.load_plan(write_plan(tmp_path))
    assert [s.id for s in plan.slices] == ["g-json", "verdict", "e2e"]
    assert plan.arms["ddtree-auto"].env == {"SGLANG_DDTREE_GRAMMAR": "auto"}
    assert plan.null_arm == "ddtree-auto"
    bad = {
        "unknown arm(s) ddtree-x": PLAN.replace("[plain, dflash, ddtree-auto], kinds",
                                                "[plain, ddtree-x], kinds"),
        "unknown grammar kind(s) jsn": PLAN.replace("kinds: [json, none]", "kinds: [jsn]"),
        "needs the arm 'plain'": PLAN.replace("[plain, dflash, ddtree-auto], concurrency",
                                              "[dflash, ddtree-auto], concurrency"),
        "slice verdict: needs the arm 'ddtree-auto' (the null serves it twice)": PLAN.replace(
            "[plain, dflash, ddtree-auto], concurrency", "[plain, dflash], concurrency"),
        "null_arm: unknown arm 'ddtree-x'; accepted: plain, dflash, ddtree-auto": PLAN.replace(
            "null_arm: ddtree-auto", "null_arm: ddtree-x"),
        "SGLANG_DDTREE_GRAMMAR": PLAN.replace("GRAMMAR: auto", "GRAMMAR: fast"),
        "a phase slice takes no arms and no null": PLAN.replace("phase: e2e,",
                                                                "phase: e2e, arms: [plain],"),
        "unknown key": PLAN.replace("rounds: 2", "rounds: 2\nround: 3"),
        "not valid YAML": PLAN.replace("slices:", "slices: {"),
    }
    for needle, text in bad.items():
        with pytest.raises(ConfigError, match=re.escape(needle)):
            evidence.load_plan(write_plan(tmp_path, text))
    with pytest.raises(ConfigError, match="not found"):
        evidence.load_plan(tmp_path / "missing.yaml")


def test_the_next_call_runs_what_lacks_counted_results_and_continues_where_the_last_stopped(
        tmp_path):
    plan = evidence.load_plan(write_plan(tmp_path))
    results = tmp_path / "results"
    assert pending(plan, results) == [("g-json", [1, 16]), ("verdict", [1, 64]), ("e2e", [0])]
    # a slice cut short after c = 1: only c = 16 is still short of its first result
    commit(results, slice_result("g-json", "NVIDIA H100 80GB HBM3", json_cells(1)), "a")
    assert pending(plan, results)[0] == ("g-json", [1, 16])  # c = 1 has 1 of 2
    commit(results, slice_result("g-json", "NVIDIA H200", json_cells(1) + json_cells(16)), "b")
    commit(results, slice_result("g-json", "NVIDIA H100 80GB HBM3", json_cells(16)), "c")
    assert [sid for sid, _ in pending(plan, results)] == ["verdict", "e2e"]
    # a cell where an arm is missing (its server failed) does not count
    commit(results, slice_result("verdict", "H100", [
        row("plain", "none", 1, [1, 1]), row("dflash", "none", 1, [1, 1]),
        row(TWIN, "none", 1, [1, 1])], failures={"ddtree-auto": "startup failed"}), "a")
    assert pending(plan, results)[0] == ("verdict", [1, 64])
    # nor a noisy one (its null 1.08), nor one without a null (an older slice): shown, never
    # counted
    commit(results, slice_result("verdict", "H100", [
        row("plain", "none", 1, [100, 100]), row("dflash", "none", 1, [100, 100]),
        row("ddtree-auto", "none", 1, [108, 108]), row(TWIN, "none", 1, [100, 100])]), "b")
    commit(results, slice_result("verdict", "H100", [
        old_row("plain", "none", 1, [100, 100]), old_row("dflash", "none", 1, [100, 100]),
        old_row("ddtree-auto", "none", 1, [110, 110])], null=None), "c")
    assert pending(plan, results)[0] == ("verdict", [1, 64])
    have = evidence.counts(evidence.read_slices(results))
    assert ("verdict", "none", 1) not in have
    # a phase counts once it passed
    e2e = dict(meta=dict(slice="e2e", phase="e2e", device="H100", date="d", arms=[]), rc=1)
    commit(results, e2e, "a")
    commit(results, dict(e2e, rc=0), "b")
    commit(results, dict(e2e, rc=0), "c")
    assert [sid for sid, _ in pending(plan, results)] == ["verdict"]


def test_counted_slices_combine_through_their_own_time_ratios_with_their_nulls(tmp_path):
    plan = evidence.load_plan(write_plan(tmp_path))
    results = tmp_path / "results"
    # two cards, very different absolute rates, the same ratios inside each slice
    commit(results, slice_result("g-json", "NVIDIA H100", json_cells(1, null=1.01)), "a")
    commit(results, slice_result("g-json", "NVIDIA H200", json_cells(
        1, dd=(330, 390), df=(300, 300), pl=(270, 300), null=0.98)), "b")
    # a third slice whose null is off by 7%: its 2.0 must not move the combined ratio
    commit(results, slice_result("g-json", "NVIDIA H100", json_cells(
        1, dd=(200, 200), null=1.07)), "c")
    cells = {(e["kind"], e["arm"]): e for e in evidence.combined_cells(
        plan, evidence.read_slices(results))}
    auto = cells[("json", "ddtree-auto")]
    # per slice: median of the paired rounds' time ratios (100/110 s ... ) = 1.15; 1.2
    assert auto["x_dflash"] == [1.15, 1.2] and auto["nulls"] == [1.01, 0.98]
    assert auto["x_plain"] == [1.211, 1.261]  # (110/90, 120/100); (330/270, 390/300)
    # the tax: the median round's tok/s with the grammar / without, same slice's servers
    assert auto["tax"] == [0.75, 2.438] and auto["tax_dflash"] == [0.667, 2.0]
    assert auto["accept"] == [4.0, 4.0] and auto["accept_dflash"] == [3.0, 3.0]
    assert auto["cards"] == ["NVIDIA H100", "NVIDIA H200"]
    assert cells[("none", "ddtree-auto")]["tax"] == []  # no tax without a grammar
    assert ("json", TWIN) not in cells  # the null's twin is the null, not an arm
    md = evidence.report_markdown(plan, evidence.read_slices(results))
    line = next(x for x in md.splitlines() if x.startswith("| g-json | json | 1 | ddtree-auto"))
    assert "| 1.17 [1.15-1.20] | 1.24 [1.21-1.26] |" in line
    assert "| 2 | 1.010, 0.980 | H100, H200 |" in line
    assert "[1](g-json/a/) [2](g-json/b/)" in line and "g-json/c" not in line
    # counted per cell: slice c's none cell had a quiet null and counts, its json cell not
    assert "| g-json | none | 1 | ddtree-auto |" in md
    left_out = [x for x in md.splitlines() if "g-json/c/" in x and "noisy" in x]
    assert len(left_out) == 2  # dflash and ddtree-auto, both measured in that noisy cell
    assert left_out[1].startswith("| g-json | json | 1 | ddtree-auto | 2.00 |")
    assert "| 1.070 | noisy: null 1.070 outside 0.95-1.05 |" in left_out[1]
    assert "Pending (2 counted results per cell wanted): g-json (item 1) at c = 16; verdict" \
        in md
    png = evidence.plot(plan, evidence.read_slices(results), tmp_path / "e.png")
    assert png and png.stat().st_size > 1000


def test_a_slice_reports_its_null_beside_its_ratios():
    """slice.md: the null per cell beside the time ratios, the worst one in the header, noisy
    cells named; slice.json's null summary says the same."""
    rows = json_cells(1, null=1.02)[:4] + json_cells(16)[4:7] + \
        [row(TWIN, "none", 16, [160 / 0.9, 160 / 0.9])]
    summary = slices.null_summary(rows, "ddtree-auto")
    assert summary["cells"]["json@1"]["median"] == 1.02
    assert summary["worst"] == 0.9 and summary["noisy"] == ["none@16"]
    res = dict(slice_result("g-json", "NVIDIA H100", rows), null=summary, greedy_vs_plain={})
    res["meta"].update(command="c", max_new_tokens=128, rounds=2, seconds=6)
    md = slices.markdown(res)
    assert "worst cell 0.9; **noisy (outside 0.95-1.05): none@16** - those cells do not count" \
        in md
    json_line = next(x for x in md.splitlines() if x.startswith("| json | 1 |"))
    assert "| 1.020 [1.020-1.020] | **1.15** [1.10-1.20] |" in json_line
    assert "fixed work: every arm of a cell serves the same request list" in md
    assert "0.900 [0.900-0.900] **noisy**" in md


def test_the_report_lists_every_profile_with_its_commit(tmp_path):
    """A profile phase's results (bench/profile.py tables under its outputs) become one row per
    arm@batch: span, GPU busy / idle, launches per step, so a profile before a rebuild of the
    step and one after sit side by side."""
    plan = evidence.load_plan(write_plan(tmp_path))
    table = dict(span_ms=4.1, busy_ms=2.5, idle_ms=1.6, launches=dict(
        recorded=True, eager=37.0, graph=2.0, memcpy=5.0, memset=1.0))
    res = dict(meta=dict(slice="profile-testbed", phase="profile", device="NVIDIA H100",
                         date="d", commit="c83c298", arms=[]), rc=0,
               outputs={"profile/results.json": {"profiles": {
                   "ddtree-default@64": table,
                   "dflash@64": dict(table, launches=dict(recorded=False))}}})
    commit(tmp_path / "r", res, "a")
    md = evidence.report_markdown(plan, evidence.read_slices(tmp_path / "r"))
    assert "| profile-testbed | c83c298 | H100 | ddtree-default@64 | 4.1 | 2.5 | 1.6 | 37.0 | " \
           "2.0 | 5.0 / 1.0 | [profile-testbed/a](profile-testbed/a/) |" in md
    assert "| dflash@64 | 4.1 | 2.5 | 1.6 | - | - | - |" in md


def test_estimates_stamps_and_the_serving_config(tmp_path):
    plan = evidence.load_plan(write_plan(tmp_path))
    g, v, e2e = plan.slices
    # 3 arms + the null's twin x (2 rounds x (4 s + 1.5 s) + a 1.5 s probe) per cell,
    # 2 kinds x 2 levels, + startup 200
    assert evidence.estimate_seconds(plan, g, [1, 16]) == pytest.approx(200 + 4 * 12.5 * 4)
    assert evidence.estimate_seconds(plan, e2e, [0]) == 400
    cfg = evidence.slice_config(plan, v, ROOT, [64])
    assert cfg.concurrency == [64] and cfg.cell_seconds == 8 and cfg.repeats == 2
    assert cfg.interleave and cfg.warmup_per_cell and cfg.startup_group == 4
    assert not cfg.min_cell_seconds and not cfg.min_cell_requests  # fixed work, not a time
    assert [a.name for a in cfg.arms] == ["plain", "dflash", "ddtree-auto", TWIN]
    assert cfg.arms[3].env == cfg.arms[2].env  # the same server, twice
    assert evidence.stamp("2026-12-07", "NVIDIA H100 80GB HBM3", []) == "2026-12-07_h10080gbhbm3_1"
    assert evidence.stamp("2026-12-07", "NVIDIA H200", ["2026-12-07_h200_1"]) == \
        "2026-12-07_h200_2"


def test_adopt_files_returned_slices_and_refuses_to_overwrite(tmp_path, capsys):
    """Adopting a batch again changes nothing (the same files: left as they are); a folder of
    the same name with other files refuses the whole batch before anything is written."""
    plan_path = write_plan(tmp_path)
    returned = tmp_path / "out"
    commit(returned, slice_result("g-json", "NVIDIA H100", json_cells(1)), "2026-12-07_h100_1")
    results = tmp_path / "results"
    args = ["--plan", str(plan_path), "--results", str(results)]
    assert evidence_cli.main(args + ["adopt", str(returned)]) == 0
    assert (results / "g-json" / "2026-12-07_h100_1" / "slice.json").is_file()
    report = (results / "README.md").read_text()
    assert "| g-json | json | 1 | ddtree-auto" in report
    capsys.readouterr()
    assert evidence_cli.main(args + ["adopt", str(returned)]) == 0
    assert "adopted already: " in capsys.readouterr().out
    assert (results / "README.md").read_text() == report
    commit(returned, slice_result("g-json", "NVIDIA H100", json_cells(16)), "2026-12-07_h100_2")
    (returned / "g-json" / "2026-12-07_h100_1" / "slice.md").write_text("another run")
    assert evidence_cli.main(args + ["adopt", str(returned)]) == 2
    assert "2026-12-07_h100_1 exists already with other files" in capsys.readouterr().err
    assert not (results / "g-json" / "2026-12-07_h100_2").exists()
    assert evidence_cli.main(args + ["adopt", str(tmp_path / "empty")]) == 2
    assert evidence_cli.main(args + ["next"]) == 0
    assert "g-json (item 1, c = 1, 16)" in capsys.readouterr().out
    assert evidence_cli.main(args + ["run", "--out", str(tmp_path / "o"), "--only", "g-jsn"]) == 2
    assert "--only: unknown slice(s) g-jsn; accepted: g-json, verdict, e2e" in \
        capsys.readouterr().err


def test_the_shipped_plan_is_valid_and_every_phase_and_config_exists():
    plan = evidence.load_plan(ROOT / "configs" / "evidence.yaml")
    script = (ROOT / "scripts" / "gpu_run.sh").read_text()
    for s in plan.slices:
        if s.phase:
            assert f"\n  {s.phase})" in script
            if "CONFIG" in s.env:  # the phase's config loads, and names the arms it picks
                cfg = load_config(ROOT / s.env["CONFIG"])
                names = [a.name for a in (run.cost_arms(cfg) if cfg.cost_mode.enabled
                                          else cfg.arms)]
                assert set(s.env.get("ARMS", ",".join(names)).split(",")) <= set(names)
        else:  # every serving slice serves the shipped defaults twice (on the hybrid testbed:
            # the defaults with the opt-in hybrids need) and its first level fits
            null = "ddtree-hybrid" if s.shapes == "hybrid-testbed" else "ddtree-default"
            assert evidence.null_of(plan, s) == null and null in s.arms
            assert evidence.estimate_seconds(plan, s, s.concurrency[:1]) < plan.call_seconds
    assert "evidence)" in script
    profiles = {s.id: s for s in plan.slices if s.phase == "profile"}
    assert set(profiles) == {"profile-testbed", "profile-8b"}
    testbed = load_config(ROOT / profiles["profile-testbed"].env["CONFIG"])
    assert [a.name for a in testbed.arms] == ["dflash", "ddtree-default", "ddtree-b15"]
    assert testbed.profile.batches == [1, 16, 64] and testbed.profile.launches
    assert testbed.profile.host_samples
    assert run.arm_env(testbed.arms[2]) == {"SGLANG_DDTREE_BUDGETS": "off"}
    qwen = load_config(ROOT / profiles["profile-8b"].env["CONFIG"])
    assert qwen.cost_mode.enabled and qwen.profile.batches == [1, 64] and qwen.profile.launches
    assert profiles["profile-8b"].env["ARMS"] == "dflash,ddtree-default,ddtree-b15"


def test_the_committed_slices_without_a_null_are_shown_but_do_not_count():
    """The slices adopted before nulls (2026-12-07, H100, commit c83c298): the phases count,
    the grammar slice's cells are listed as not counted and stay pending."""
    plan = evidence.load_plan(ROOT / "configs" / "evidence.yaml")
    found = evidence.read_slices(ROOT / "benchmarks" / "results" / "evidence")
    grammar = next(r for r in found if r["meta"]["slice"] == "grammar-json_bounded")
    assert evidence.cells_of(grammar) and not evidence.counted_cells(grammar)
    have = evidence.counts(found)
    assert have[("e2e-page16", "phase", 0)] == 1
    todo = dict((s.id, lv) for s, lv in evidence.next_slices(plan, have))
    assert todo["grammar-json_bounded"] == [1, 16, 64] and todo["e2e-page16"] == [0]
    md = evidence.report_markdown(plan, found)
    assert "| grammar-json_bounded | json_bounded | 16 | ddtree-auto | 1.62 | 0.73 | - | no " \
           "null |" in md


def test_the_committed_stand_in_batch_passes_and_names_its_change():
    """The batch run on 5333599 plus a stand-in for _max_batch_size (2026-12-07, H100;
    e2e-hybrid in bfloat16 too): every arm started and passed, yet a run on a stand-in does not
    count (the plan still owes e2e at a commit as committed); each carries its note, and the
    report shows its commit as not as committed."""
    plan = evidence.load_plan(ROOT / "configs" / "evidence.yaml")
    found = evidence.read_slices(ROOT / "benchmarks" / "results" / "evidence")
    batch = [r for r in found if r["meta"]["commit"].startswith("5333599")]
    assert sorted(r["folder"] for r in batch) == [
        "e2e-hybrid/2026-12-07_h10080gbhbm3_1", "e2e/2026-12-07_h10080gbhbm3_2",
        "profile-testbed/2026-12-07_h10080gbhbm3_1"]
    for r in batch:
        assert evidence.slice_failures(r) == {} and evidence.counted_cells(r) == set()
        assert "arbitrary bound of 256" in r["meta"]["note"]
    e2e = next(r for r in batch if r["meta"]["slice"] == "e2e")
    assert [a["arm"] for a in e2e["outputs"]["e2e/e2e.json"]["arms"]] == [
        "ddtree_triton", "ddtree_b15auto", "ddtree_b0switch", "plain_triton"]
    have = evidence.counts(found)
    assert have.get(("e2e", "phase", 0)) == 1 and "e2e" in {
        s.id for s, _ in evidence.next_slices(plan, have)}
    md = evidence.report_markdown(plan, found)
    assert "| e2e | passed (exit 0) | 5333599+maxbs-patch (not as committed: note 1) |" in md
    assert "| e2e-hybrid | passed (exit 0) | 5333599+maxbs-patch+bf16 (not as committed: " \
           "note 1) |" in md
    assert "1. 5333599+maxbs-patch, 5333599+maxbs-patch+bf16: Stand-in, not 5333599 as " \
           "committed" in md
    readme = (ROOT / "benchmarks" / "results" / "evidence" / "README.md").read_text()
    assert "| e2e | passed (exit 0) | 5333599+maxbs-patch (not as committed: note 1) |" in readme


def test_a_call_runs_the_next_slice_against_stand_in_servers(tmp_path, monkeypatch, capsys):
    """The runner end to end with the stand-in server (tests/fake_sglang_server.py): a call
    without the time for a slice's first level starts nothing; one with time runs every level
    on fixed work with the null's twin beside, logs one line per measurement and per cell (no
    progress bars), writes slice.json / slice.md / logs.tgz; adopted, the next call's list
    starts past it."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'tests'}:{ROOT / 'src'}")
    plan_path = write_plan(tmp_path, PLAN.replace("rounds: 2", "rounds: 1").replace(
        "arms: [plain, dflash, ddtree-auto], kinds", "arms: [plain, ddtree-auto], kinds").replace(
        "\nseconds: 4\n", "\nseconds: 0.1\nstartup_seconds: 5"
                          "\nlauncher_module: fake_sglang_server\n"))
    results, out = tmp_path / "results", tmp_path / "out"
    args = ["--plan", str(plan_path), "--results", str(results)]
    # a level of g-json needs ~5 + 2 kinds x 3 servers x (1 round x 1.6 s + 1.5 s): not in 8 s
    assert evidence_cli.main(args + ["run", "--out", str(out), "--seconds", "8",
                                     "--only", "g-json"]) == 0
    assert "skip g-json" in capsys.readouterr().out and not out.exists()
    assert evidence_cli.main(args + ["run", "--out", str(out), "--seconds", "300",
                                     "--only", "g-json"]) == 0
    log = capsys.readouterr()
    folder = next((out / "g-json").iterdir())
    res = json.loads((folder / "slice.json").read_text())
    assert evidence.cells_of(res) == {("json", 1), ("none", 1), ("json", 16), ("none", 16)}
    assert res["cells_skipped"] == [] and res["failures"] == {}
    assert res["meta"]["arms"] == ["plain", "ddtree-auto", TWIN]
    assert res["meta"]["null"] == dict(arm="ddtree-auto", twin=TWIN, server="twin")
    assert set(res["null"]["cells"]) == {"json@1", "none@1", "json@16", "none@16"}
    for kind, conc in evidence.cells_of(res):  # one request list per cell, every arm
        cell = evidence.cell_rows(res, kind, conc)
        assert len({r["requests"] for r in cell}) == 1 and cell[0]["requests"] >= conc
        assert len({tuple(r["rounds_output_tokens"]) for r in cell}) == 1
    assert res["greedy_vs_plain"]["json"]["ddtree-auto"]["identical"] > 0
    assert sorted(p.name for p in folder.iterdir()) == ["logs.tgz", "slice.json", "slice.md"]
    assert "Null: `ddtree-auto` against a second server of itself" in \
        (folder / "slice.md").read_text()
    rounds = [x for x in log.out.splitlines() if " round 1/1 " in x]
    assert len(rounds) == 4 * 3  # 4 cells x 3 servers
    assert all(re.search(r" c=\d+ +round 1/1 +\d+ requests +[\d.]+ s +[\d,]+ tok/s$", x)
               for x in rounds)
    assert len([x for x in log.out.splitlines() if re.match(r"cell \w+@\d+: \d+ requests; "
                                                            r"null \d\.\d{3}", x)]) == 4
    assert "\r" not in log.out + log.err and "it/s" not in log.out + log.err
    assert "evidence call: 1 slice(s)" in log.out
    assert evidence_cli.main(args + ["adopt", str(out)]) == 0
    capsys.readouterr()
    assert evidence_cli.main(args + ["next"]) == 0
    assert "g-json (item 1, c = 1, 16)" in capsys.readouterr().out  # at most 1 of 2 per cell


def test_a_null_on_its_own_server_measures_that_server_twice(tmp_path, monkeypatch, capsys):
    """null_server "same" (a card that holds no further server): the twin starts no server
    of its own; each round measures the null's server twice, as two arms of the cell."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'tests'}:{ROOT / 'src'}")
    plan_path = write_plan(tmp_path, PLAN.replace("rounds: 2", "rounds: 1").replace(
        "concurrency: [1, 64],\n     seconds: 8}", "concurrency: [1],\n     seconds: 0.1, "
        "null_server: same}").replace("\nseconds: 4\n", "\nseconds: 0.1\nstartup_seconds: 5"
                                     "\nlauncher_module: fake_sglang_server\n"))
    plan = evidence.load_plan(plan_path)
    verdict = next(s for s in plan.slices if s.id == "verdict")
    assert [a.name for a in evidence.slice_servers(plan, verdict)] == [
        "plain", "dflash", "ddtree-auto"]
    out = tmp_path / "out"
    assert evidence_cli.main(["--plan", str(plan_path), "--results", str(tmp_path / "r"), "run",
                              "--out", str(out), "--seconds", "300", "--only", "verdict"]) == 0
    folder = next((out / "verdict").iterdir())
    res = json.loads((folder / "slice.json").read_text())
    assert res["meta"]["null"] == dict(arm="ddtree-auto", twin=TWIN, server="same")
    assert sorted(r["arm"] for r in res["rows"]) == sorted(["plain", "dflash", "ddtree-auto",
                                                            TWIN])
    assert slices.null_ratio(res["rows"], "ddtree-auto") is not None
    with tarfile.open(folder / "logs.tgz") as tar:
        servers = [n for n in tar.getnames() if "/server_" in n or n.startswith("logs/")]
    assert not any(TWIN in n for n in servers)  # no server of its own
    assert "against its own server measured a second time in each round" in \
        (folder / "slice.md").read_text()
    capsys.readouterr()


def test_the_8b_verdict_slices_fit_their_card_and_force_every_arm_s_acceptance():
    """Issue 55's slices at Qwen3-8B shapes: each runs on its card only (H100 and H200 are
    separate verdicts); random weights in bfloat16; DFLASH at SGLang's simulated length and
    every DDTREE arm at a curve the server accepts for its candidate budgets; at most three
    servers (two at c >= 128 on an H100), the null measured on its own server; each server's
    KV holds every request of its highest level at once; a slice fits one device call."""
    from ddtree_sglang.sglang_plugin.settings import DDTreeSettings

    plan = evidence.load_plan(ROOT / "configs" / "evidence.yaml")
    eight_b = [s for s in plan.slices if s.shapes == "qwen3-8b"]
    assert {s.card for s in eight_b} == {"h100", "h200"} and len(eight_b) >= 8
    ids = [s.id for s in plan.slices]
    assert max(ids.index(s.id) for s in eight_b) < ids.index("verdict-low")  # ahead of it
    for s in eight_b:
        cfg = evidence.slice_config(plan, s, ROOT)
        servers = evidence.slice_servers(plan, s)
        assert cfg.random_weights and cfg.dtype == "bfloat16" and s.null_server == "same"
        assert len(servers) <= (2 if s.card == "h100" and min(s.concurrency) >= 128 else 3)
        assert cfg.max_total_tokens >= max(s.concurrency) * (
            s.prompt_len + cfg.max_new_tokens + 66), s.id
        assert evidence.estimate_seconds(plan, s, s.concurrency) < plan.call_seconds, s.id
        for arm in servers:
            env = run.arm_env(arm)
            if arm.algorithm == "DFLASH":
                assert float(env["SGLANG_SIMULATE_ACC_LEN"]) in (7.79, 4.28)
            elif arm.algorithm == "DDTREE":
                settings = DDTreeSettings.from_values(32, 16, environ=env)  # refused if not
                assert settings.simulate_acc and settings.budgets[-1] == 32
    h100 = {s.id for s, _ in evidence.next_slices(plan, {}, "NVIDIA H100 80GB HBM3")}
    h200 = {s.id for s, _ in evidence.next_slices(plan, {}, "NVIDIA H200")}
    assert {s.id for s in eight_b if s.card == "h100"} <= h100 and not any(
        s.card == "h200" and s.id in h100 for s in eight_b)
    assert {s.id for s in eight_b if s.card == "h200"} <= h200


def test_a_slice_past_its_deadline_starts_no_cell(tmp_path, monkeypatch):
    """measure_slice checks each cell's estimate (servers x (rounds x (seconds + 1.5 s) +
    1.5 s)) against the deadline before starting it, and names the cells it left out."""
    import time

    from ddtree_bench import cells

    monkeypatch.setenv("PYTHONPATH", f"{ROOT / 'tests'}:{ROOT / 'src'}")
    plan = evidence.load_plan(write_plan(tmp_path, PLAN + "launcher_module: fake_sglang_server\n"))
    cfg = evidence.slice_config(plan, plan.slices[0], ROOT)
    assert cells.cell_estimate(cfg, 4) == pytest.approx(4 * (2 * 5.5 + 1.5))
    results = dict(rows=[], greedy_vs_plain={}, failures={})
    slices.measure_slice(cfg, ["json", "none"], tmp_path, results, lambda: None,
                         stop_at=time.monotonic() + 10, null="ddtree-auto")  # < one cell's 50 s
    assert results["rows"] == [] and results["failures"] == {}
    assert results["cells_skipped"] == [dict(kind=k, concurrency=c) for c in (1, 16)
                                        for k in ("json", "none")]


# -- failed slices: a dead arm, request errors, a traceback, a leak -----------------------------

# What a DDTREE server printed when it died at startup at 5333599 (test_server_log's sample)
STARTUP_CRASH = CRASH_LOG
CUDA_CRASH = "RuntimeError: CUDA error: an illegal memory access was encountered"
LOAD_CRASH = f"""[2026-12-07 15:29:02] Decode batch, #running-req: 32, #token: 9000, accept len: 3.1
[2026-12-07 15:29:02] Scheduler hit an exception: Traceback (most recent call last):
  File "src/ddtree_sglang/sglang_plugin/worker.py", line 310, in forward_batch_generation
    verified = self.verify(batch)
{CUDA_CRASH}
"""


def e2e_passed(arm: str) -> dict:
    """An arm of tests/gpu/e2e_server.py's e2e.json that passed every check (as on the H100,
    2026-12-07)."""
    return dict(arm=arm, healthy_after_s=91.0, openai_completions=True, openai_chat=True,
                openai_n2_choices=2, greedy_seconds=0.99, greedy_errors=[], accept_length=3.342,
                mixed_ok=24, kv_tokens_after_flush=0, alive_at_end=True, leak_in_log=False,
                traceback_in_log=False, tokens_equal_to_plain=2048)


def e2e_dead(arm: str, log: str) -> dict:
    """An arm whose server never became healthy: e2e_server.check_arm records its error (the
    server's log tail) and nothing else."""
    tail = "\n".join(log.splitlines()[-40:])
    return dict(arm=arm, error=f"startup failed: server {arm} exited with 1; log tail:\n"
                               f"{tail}"[-3000:])


def fake_e2e_phase(records: list[dict], logs: dict[str, str]):
    """subprocess.run, but `bash scripts/gpu_run.sh e2e` writes what that phase writes: e2e.json
    and the servers' logs packed into logs.tgz (exit 0: e2e_server.py exits 0 whatever the
    arms did)."""
    real = subprocess.run

    def run_(cmd, **kw):
        if cmd[:2] != ["bash", "scripts/gpu_run.sh"]:
            return real(cmd, **kw)
        work = Path(kw["env"]["OUT"]) / "e2e"
        (work / "logs").mkdir(parents=True)
        for arm, text in logs.items():
            (work / "logs" / f"server_{arm}.log").write_text(text)
        with tarfile.open(work / "logs.tgz", "w:gz") as tar:
            tar.add(work / "logs", arcname="logs")
        for f in (work / "logs").iterdir():
            f.unlink()
        (work / "logs").rmdir()
        (work / "e2e.json").write_text(json.dumps(dict(meta=dict(device="NVIDIA H100"),
                                                       arms=records)))
        kw["stdout"].write("".join(json.dumps(r) + "\n" for r in records))
        return subprocess.CompletedProcess(cmd, 0)

    return run_


DEAD_AT_STARTUP = (
    [e2e_dead(a, STARTUP_CRASH) for a in ("ddtree_triton", "ddtree_b15auto")]
    + [e2e_passed("plain_triton")],
    {"ddtree_triton": STARTUP_CRASH, "ddtree_b15auto": STARTUP_CRASH, "plain_triton": ""},
    {"ddtree_triton": f"did not start: {ROOT_CAUSE}",
     "ddtree_b15auto": f"did not start: {ROOT_CAUSE}"})
DIED_UNDER_LOAD = (  # healthy, then its requests failed: the check's error, a traceback logged
    [dict(e2e_passed("ddtree_triton"), error="URLError: <urlopen error [Errno 111] Connection "
          "refused>", traceback_in_log=True, alive_at_end=None), e2e_passed("plain_triton")],
    {"ddtree_triton": LOAD_CRASH, "plain_triton": ""},
    {"ddtree_triton": f"failed its checks: {CUDA_CRASH}"})


@pytest.mark.parametrize("records, logs, failed", [DEAD_AT_STARTUP, DIED_UNDER_LOAD],
                         ids=["dead-at-startup", "died-under-load"])
def test_an_e2e_slice_with_a_failed_arm_fails_and_counts_nothing(tmp_path, monkeypatch, capsys,
                                                                   records, logs, failed):
    """The phase exits 0 whatever its arms did; the runner reads e2e.json and the servers'
    logs: the slice is failed, names each failed arm with its first error line (its server
    log's traceback), counts nothing, and the call exits 1."""
    monkeypatch.setattr(evidence_cli.subprocess, "run", fake_e2e_phase(records, logs))
    results, out = tmp_path / "results", tmp_path / "out"
    args = ["--plan", str(write_plan(tmp_path)), "--results", str(results)]
    assert evidence_cli.main(args + ["run", "--out", str(out), "--seconds", "500",
                                     "--only", "e2e"]) == 1
    printed = capsys.readouterr().out
    folder = next((out / "e2e").iterdir())
    res = json.loads((folder / "slice.json").read_text())
    assert res["rc"] == 0 and evidence.slice_failures(res) == failed
    assert evidence.cells_of(res) == {("phase", 0)} and evidence.counted_cells(res) == set()
    md = (folder / "slice.md").read_text()
    assert md.startswith("# e2e: phase e2e, exit 0\n\n**Failed: this slice counts nothing.**")
    for arm, line in failed.items():
        assert f"- `{arm}`: {line}" in md and f"FAILED e2e: {arm}: {line}" in printed
    assert f"| phase | no | - | - | {', '.join(failed)} | exit 0 |" in printed
    with tarfile.open(folder / "logs.tgz") as tar:  # the phase's own log travels too
        assert {"phase.log", "phase/e2e/e2e.json", "phase/e2e/logs.tgz"} <= set(tar.getnames())
    assert evidence_cli.main(args + ["adopt", str(out)]) == 0
    report = (results / "README.md").read_text()
    assert re.search(r"\| e2e \| \*\*failed\*\* \(exit 0\) \| \S+ \|", report)
    arm, line = next(iter(failed.items()))
    assert f"`{arm}`: {line}" in report and "e2e (item 4, phase e2e)" in report


def test_a_serving_slice_with_an_arm_that_did_not_start_fails_and_counts_nothing(
        tmp_path, monkeypatch, capsys):
    """Against stand-in servers, DFLASH's dies at startup with a Python traceback: its cells
    are measured without it (plain, DDTREE and the null's twin), but the slice is failed,
    named with DFLASH's first error line (whatever its null says), and the call exits 1."""
    (tmp_path / "crashing_server.py").write_text(
        "import runpy, sys\n"
        "model_runner = type('ModelRunner', (), {'req_to_token_pool': None})\n"
        "if 'DFLASH' in sys.argv:\n"
        "    model_runner.req_to_token_pool.req_to_token\n"
        "runpy.run_module('fake_sglang_server', run_name='__main__')\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{ROOT / 'tests'}:{ROOT / 'src'}")
    plan = PLAN.replace("rounds: 2", "rounds: 1").replace(
        "\nseconds: 4\n", "\nseconds: 0.1\nstartup_seconds: 5\n"
                          "launcher_module: crashing_server\n").replace(
        "kinds: [json, none],\n     concurrency: [1, 16]", "kinds: [none], concurrency: [1]")
    results, out = tmp_path / "results", tmp_path / "out"
    args = ["--plan", str(write_plan(tmp_path, plan)), "--results", str(results)]
    assert evidence_cli.main(args + ["run", "--out", str(out), "--seconds", "300",
                                     "--only", "g-json"]) == 1
    printed = capsys.readouterr().out
    folder = next((out / "g-json").iterdir())
    res = json.loads((folder / "slice.json").read_text())
    assert set(res["failures"]) == {"dflash"} and res["log_errors"] == {"dflash": ROOT_CAUSE}
    assert evidence.slice_failures(res) == {"dflash": f"did not start: {ROOT_CAUSE}"}
    assert evidence.cells_of(res) == {("none", 1)} and evidence.counted_cells(res) == set()
    assert evidence.why_not_counted(res, "none", 1) == f"failed: dflash: did not start: " \
                                                       f"{ROOT_CAUSE}"
    assert f"- `dflash`: did not start: {ROOT_CAUSE}" in (folder / "slice.md").read_text()
    assert f"FAILED g-json: dflash: did not start: {ROOT_CAUSE}" in printed
    assert "| 0 of 1 | " in printed and res["not_alive_at_end"] == []


def test_every_kind_of_failure_is_named_with_its_first_error_line():
    """slice_failures over the records the harness writes: e2e.json flags, a serving run's
    rows and failures (also as a phase's output), servers dead by the end, a phase's exit, a
    runner's error; a slice without any passes."""
    def phase(*arms, rc=0, **extra):
        return dict(meta=dict(slice="e2e", phase="e2e"), rc=rc,
                    outputs={"e2e/e2e.json": dict(arms=list(arms))}, **extra)

    assert evidence.slice_failures(phase(e2e_passed("ddtree_triton"))) == {}
    flagged = {"greedy_errors": [{"status": 500, "body": "boom"}], "traceback_in_log": True,
               "alive_at_end": False, "leak_in_log": True}
    want = {"greedy_errors": "request errors: {'status': 500, 'body': 'boom'}",
            "traceback_in_log": "a traceback in its log", "alive_at_end": "not alive at the end",
            "leak_in_log": "a leak in its log"}
    for key, value in flagged.items():
        res = phase(dict(e2e_passed("ddtree_triton"), **{key: value}))
        assert evidence.slice_failures(res) == {"ddtree_triton": want[key]}
    leak = "[t] ValueError: token_to_kv_pool_allocator memory leak detected!"
    res = phase(dict(e2e_passed("ddtree_triton"), leak_in_log=True),
                log_errors={"ddtree_triton": leak})
    assert evidence.slice_failures(res) == {"ddtree_triton": f"a leak in its log: {leak}"}
    assert evidence.slice_failures(phase(rc=124)) == {"phase": "exit 124"}
    serving = slice_result("verdict", "H100", [
        dict(row("ddtree-auto", "none", 16, [1, 1]), errors=3,
             first_error="RuntimeError: HTTP 500")], failures={"dflash": "RuntimeError: server "
                                                               "dflash exited with 1; log tail:"})
    serving.update(not_alive_at_end=["plain"], error="KeyError: 'rows'",
                   log_errors={"ddtree-auto-null": CUDA_CRASH})
    assert evidence.slice_failures(serving) == {
        "runner": "the slice stopped: KeyError: 'rows'",
        "dflash": "did not start: RuntimeError: server dflash exited with 1; log tail:",
        "ddtree-auto": "3 request errors at none@16: RuntimeError: HTTP 500",
        "plain": "not alive at the end", "ddtree-auto-null": f"its server log: {CUDA_CRASH}"}
    profile = dict(meta=dict(slice="profile-testbed", phase="profile"), rc=0, outputs={
        "profile/results.json": dict(failures={"profile ddtree-b15@64": "TimeoutError: t"},
                                     rows=[dict(arm="dflash", concurrency=1, errors=1,
                                                first_error="E")])})
    assert evidence.slice_failures(profile) == {
        "profile ddtree-b15@64": "failed: TimeoutError: t", "dflash": "1 request errors at c = 1: E"}
    # a check cut short (a timeout; or stopped before its first arm, no e2e.json): exit 0
    asked = dict(slice="e2e", phase="e2e", env=dict(ARMS="ddtree_triton,plain_triton"))
    assert evidence.slice_failures(dict(phase(e2e_passed("ddtree_triton")), meta=asked)) == {
        "plain_triton": "not checked: the phase stopped before it"}
    assert set(evidence.slice_failures(dict(meta=asked, rc=0, outputs={}))) == {
        "ddtree_triton", "plain_triton"}
    features = dict(meta=dict(slice="features-auto", phase="features"), rc=0, outputs={
        "features/features.json": dict(health=dict(
            ddtree=dict(alive=False, leak_in_log=False, traceback_in_log=False),
            plain=dict(alive=True, leak_in_log=False, traceback_in_log=False)))})
    assert evidence.slice_failures(features) == {"ddtree": "not alive at the end"}


def test_adopt_records_a_note_on_what_the_code_that_ran_changed(tmp_path, capsys):
    """A batch run on its commit plus a stand-in change: `adopt --note` records the note in
    each slice.json and atop its slice.md; the report shows each such slice's commit with its
    note's number and the note under the tables.  Adopting again with the same note changes
    nothing; with another note it is refused."""
    plan_path = write_plan(tmp_path)
    returned, results = tmp_path / "batch", tmp_path / "results"
    e2e = dict(meta=dict(slice="e2e", phase="e2e", device="NVIDIA H100 80GB HBM3",
                         date="2026-12-07", commit="5333599+maxbs-patch", arms=[]), rc=0,
               outputs={"e2e/e2e.json": dict(arms=[e2e_passed("ddtree_triton"),
                                                   e2e_passed("plain_triton")])})
    commit(returned, e2e, "2026-12-07_h10080gbhbm3_2")
    (returned / "e2e" / "2026-12-07_h10080gbhbm3_2" / "slice.md").write_text("# e2e\n")
    note = ("stand-in change, not 5333599 as committed: _max_batch_size bounded at 256 where "
            "the request pool was None.")
    args = ["--plan", str(plan_path), "--results", str(results)]
    assert evidence_cli.main(args + ["adopt", str(returned), "--note", note]) == 0
    adopted = results / "e2e" / "2026-12-07_h10080gbhbm3_2"
    assert json.loads((adopted / "slice.json").read_text())["meta"]["note"] == note
    assert (adopted / "slice.md").read_text() == f"> Note (given at adoption): {note}\n\n# e2e\n"
    report = (results / "README.md").read_text()
    assert "| e2e | passed (exit 0) | 5333599+maxbs-patch (not as committed: note 1) | NVIDIA " \
           "H100 80GB HBM3 | 2026-12-07 |" in report
    assert f"1. 5333599+maxbs-patch: {note} Slices: [e2e/2026-12-07_h10080gbhbm3_2]" in report
    assert evidence_cli.main(args + ["adopt", str(returned), "--note", note]) == 0
    assert (results / "README.md").read_text() == report
    capsys.readouterr()
    assert evidence_cli.main(args + ["adopt", str(returned), "--note", "other"]) == 2
    assert "exists already with other files" in capsys.readouterr().err


def test_the_8_gpu_box_serves_the_8b_verdict_s_arms_at_the_same_curve():
    """configs/pro6000x8.yaml: the verdict's arms (plain, DFLASH, the shipped defaults, 0 among
    the budgets) at Qwen3-8B shapes with the acceptance the evidence plan's H100 slices force,
    concurrency 1..256: its first run is one command."""
    plan = evidence.load_plan(ROOT / "configs" / "evidence.yaml")
    h100 = next(s for s in plan.slices if s.id == "8b-h100-low")
    box = load_config(ROOT / "configs" / "pro6000x8.yaml")
    arms = {a.name: a for a in box.arms}
    assert box.random_weights and box.concurrency == [1, 4, 16, 64, 128, 256]
    assert set(arms) == {"plain", "dflash", "ddtree-default", "ddtree-with-0"}
    assert arms["dflash"].simulate_accept == h100.simulate["dflash"]
    assert arms["ddtree-default"].simulate_accept == h100.simulate["ddtree-default"]
    assert arms["ddtree-with-0"].simulate_accept == h100.simulate["ddtree-default"]
    assert arms["ddtree-with-0"].env == plan.arms["ddtree-with-0"].env


def test_the_hybrid_speed_slice_serves_the_hybrid_testbed_in_bfloat16():
    """Issue 57's speed slice: plain, DFLASH and DDTREE (started under unchecked until the
    hybrid e2e counts) on testbed_hybrid/ in bfloat16, DDTREE served twice for the null; the
    runner writes the testbed's generated files first (run_serving)."""
    plan = evidence.load_plan(ROOT / "configs" / "evidence.yaml")
    s = next(x for x in plan.slices if x.id == "hybrid-speed")
    cfg = evidence.slice_config(plan, s, ROOT)
    assert cfg.model_path == str(ROOT / "testbed_hybrid" / "target") and cfg.dtype == "bfloat16"
    assert cfg.draft_model_path == str(ROOT / "testbed_hybrid" / "drafter")
    assert [a.name for a in cfg.arms] == ["plain", "dflash", "ddtree-hybrid",
                                          "ddtree-hybrid-null"]
    assert cfg.arms[2].env == {"SGLANG_DDTREE_DEBUG": "unchecked"} and cfg.concurrency == [1, 16,
                                                                                            64]
    assert "restore_hybrid_testbed()" in (ROOT / "benchmarks" / "evidence.py").read_text()
