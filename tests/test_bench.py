"""The benchmark harness on CPU, against a stand-in server: replicas, streaming metrics,
correctness comparison, reports, server shutdown, config errors."""
import json
import math
import re
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the stand-in server module

from ddtree_bench import run as serve_bench  # noqa: E402
from ddtree_bench.config import BenchConfig, ConfigError, load_config  # noqa: E402


def write_config(tmp_path, **overrides):
    cfg = dict(name="fake", model_path=str(ROOT / "testbed" / "target"),
               draft_model_path=str(ROOT / "testbed" / "drafter"), gpus=[0, 0],
               arms=[{"name": "no-spec"}, {"name": "dflash", "algorithm": "DFLASH"},
                     {"name": "ddtree-b32", "algorithm": "DDTREE", "budget": 32}],
               concurrency=[1, 4], prompts={"source": str(ROOT / "testbed" / "prompts.jsonl"),
                                            "limit": 6},
               max_new_tokens=12, startup_timeout_s=60, launcher_module="fake_sglang_server")
    cfg.update(overrides)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def fake_env(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))


def test_two_replicas_end_to_end(tmp_path, fake_env):
    out = tmp_path / "res"
    rc = serve_bench.main(["--config", str(write_config(tmp_path)), "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    rows = res["rows"]
    assert {(r["arm"], r["concurrency"]) for r in rows} == {
        (a, c) for a in ("no-spec", "dflash", "ddtree-b32") for c in (1, 4)}
    for r in rows:
        assert r["errors"] == 0 and r["output_tokens"] == r["requests"] * 12
        assert set(r["per_replica_tokens"]) == {"0", "1"} or set(r["per_replica_tokens"]) == {0, 1}
        assert r["tpot_p50_ms"] is not None and r["ttft_p50_ms"] is not None
    assert rows[-1]["arm"] == "no-spec"  # the reference runs last
    spec_row = next(r for r in rows if r["arm"] == "ddtree-b32")
    assert spec_row["accept_length"] == 2.5  # OpenAI endpoint: the server's running mean
    assert res["correctness"]["ddtree-b32"]["identical"] == 6
    md = (out / "results.md").read_text()
    assert "ddtree-b32" in md and "identical" in md
    assert (out / "throughput.png").exists() and (out / "tpot.png").exists()
    logs = list((out / "logs").glob("*.log"))
    assert len(logs) == 6  # 3 arms x 2 replicas, all stopped (no process left behind)


def test_grouped_startup_measures_every_arm(tmp_path, fake_env):
    """Arms started together (fixed KV pool, sleep on idle) give the same rows as one by one."""
    out = tmp_path / "res"
    cfg = write_config(tmp_path, gpus=[0], startup_group=2, max_total_tokens=65536,
                       endpoint="native")
    assert serve_bench.main(["--config", str(cfg), "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [r["arm"] for r in res["rows"]] == ["dflash"] * 2 + ["ddtree-b32"] * 2 + ["no-spec"] * 2
    assert all(r["errors"] == 0 for r in res["rows"])
    assert res["rows"][0]["accept_length"] == 2.0  # native /generate: per-request meta_info
    assert res["correctness"]["dflash"]["identical"] == 6
    for log in (out / "logs").glob("*.log"):
        argv = log.read_text().splitlines()[0]
        assert "--max-total-tokens 65536" in argv and "--sleep-on-idle" in argv


def test_divergence_is_reported_with_tie_check(tmp_path, fake_env, monkeypatch):
    monkeypatch.setenv("FAKE_DIVERGE", "1")
    out = tmp_path / "res"
    serve_bench.main(["--config", str(write_config(tmp_path, concurrency=[2])), "--out", str(out),
                      "--arms", "no-spec,ddtree-b32"])
    c = json.loads((out / "results.json").read_text())["correctness"]["ddtree-b32"]
    assert c["identical"] == 0 and c["diverged"] == 6 and c["diverged_not_tie"] == 6
    assert c["examples"][0]["position"] == 3 and c["examples"][0]["logprob_gap"] > 3
    monkeypatch.setenv("FAKE_TIE", "1")
    serve_bench.main(["--config", str(write_config(tmp_path, concurrency=[2])), "--out", str(out),
                      "--arms", "no-spec,ddtree-b32"])
    c = json.loads((out / "results.json").read_text())["correctness"]["ddtree-b32"]
    assert c["diverged_at_near_tie"] == 6


def test_failed_arm_is_reported_and_others_run(tmp_path, fake_env, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL_ALGO", "DDTREE")
    out = tmp_path / "res"
    rc = serve_bench.main(["--config", str(write_config(tmp_path, concurrency=[1])),
                           "--out", str(out)])
    res = json.loads((out / "results.json").read_text())
    assert rc == 1 and "refusing DDTREE" in res["failures"]["ddtree-b32"]
    assert {r["arm"] for r in res["rows"]} == {"no-spec", "dflash"}
    assert "Arms that failed" in (out / "results.md").read_text()


def test_default_and_backend_arms_reach_the_server_command():
    """A DDTREE arm without a budget runs the shipped defaults (no width, no budget knob); an
    arm's own attention backend overrides the config's."""
    cfg = BenchConfig(name="x", arms=[
        {"name": "ddtree-default", "algorithm": "DDTREE"},
        {"name": "dflash-fi", "algorithm": "DFLASH", "attention_backend": "flashinfer"},
        {"name": "ddtree-b63", "algorithm": "DDTREE", "budget": 63}])
    default, dflash_fi, b63 = (serve_bench.server_spec(cfg, a, "m", "d") for a in cfg.arms)
    cmd = default.cli(1)
    assert "--speculative-num-draft-tokens" not in cmd and default.env == {}
    assert cmd[cmd.index("--attention-backend") + 1] == "triton"
    fi = dflash_fi.cli(1)
    assert fi[fi.index("--attention-backend") + 1] == "flashinfer"
    wide = b63.cli(1)
    assert wide[wide.index("--speculative-num-draft-tokens") + 1] == "64"
    assert b63.env == {"SGLANG_DDTREE_BUDGETS": "off"}
    with pytest.raises(ValueError, match="attention_backend"):
        BenchConfig(name="x", arms=[{"name": "a", "attention_backend": "fa3"}])


def test_config_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="budget applies to DDTREE only"):
        BenchConfig(name="x", arms=[{"name": "a", "algorithm": "DFLASH", "budget": 15}])
    with pytest.raises(ValueError, match="concurrency levels must be >= 1"):
        BenchConfig(name="x", arms=[{"name": "a"}], concurrency=[0])
    with pytest.raises(ValueError, match="arm names must be unique"):
        BenchConfig(name="x", arms=[{"name": "a"}, {"name": "a"}])
    with pytest.raises(ValueError, match="must be a .jsonl path or one of"):
        BenchConfig(name="x", arms=[{"name": "a"}], prompts={"source": "nope"})
    with pytest.raises(ValueError, match="startup_group > 1 needs max_total_tokens"):
        BenchConfig(name="x", arms=[{"name": "a"}], startup_group=2)
    with pytest.raises(ConfigError, match="missing.yaml not found"):
        load_config(tmp_path / "missing.yaml")
    assert serve_bench.main(["--config", str(write_config(tmp_path)), "--out", str(tmp_path),
                             "--arms", "bogus"]) == 2


def _error_line(capsys, argv) -> str:
    """Run ddtree-bench, expect exit code 2 and exactly one stderr line, return it."""
    assert serve_bench.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddtree-bench: error: "), err
    return err[0]


@pytest.mark.parametrize("text, needle", [
    ("name: x\narms: [{name: a}]\nconcurency: [1, 4]\n",
     "unknown key 'concurency'; accepted here: name, "),
    ("name: x\narms: [{name: a, algorithm: DDTREE, budegt: 32}]\n",
     "unknown key 'arms.0.budegt'; accepted here: name, algorithm, budget"),
    ("name: x\narms: [{name: a}]\ncost_mode: {enabeld: true}\n", "unknown key 'cost_mode.enabeld'"),
    ("name: x\narms: [{name: a}\n", "line 3, column 1: not valid YAML"),
    ("", "is empty"),
    ("- 1\n- 2\n", "expected a mapping of keys"),
    ("name: x\narms: [{name: a}]\ntemperature: -1\n", "temperature: Input should be greater"),
    ("name: x\narms: [{name: a}]\nconcurrency: [0]\n", "concurrency levels must be >= 1 (got [0])"),
    ("name: x\narms: [{name: a}]\nprofile: {batches: [8, 0]}\n",
     "profile.batches: every entry must be >= 1 (got [8, 0])"),
    ("name: x\narms: [{name: a}]\nprofile: {batchs: [8]}\n",
     "unknown key 'profile.batchs'; accepted here: batches, steps, new_tokens, launches"),
    ("name: x\narms: [{name: a}]\nconcurrency: []\n",
     "concurrency: at least one level is needed (or profile.batches"),
    ("name: x\narms: [{name: a}]\ninterleave: true\nmin_cell_seconds: 8\n",
     "interleaved arms serve one fixed request list per cell: set cell_seconds"),
    ("name: x\narms: [{name: a}]\ncell_seconds: 6\nmin_cell_requests: 8\n",
     "cell_seconds (fixed work) and min_cell_seconds / min_cell_requests"),
])
def test_bad_configs_end_in_one_line_naming_the_file(tmp_path, capsys, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    line = _error_line(capsys, ["--config", str(path), "--dry-run"])
    assert str(path) in line and needle in line, line


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path, capsys):
    cfg = write_config(tmp_path, launcher_module="no_such_module_would_fail_to_start")
    assert serve_bench.main(["--config", str(cfg), "--dry-run", "--concurrency", "2"]) == 0
    out = capsys.readouterr().out
    assert "3 arms x 2 replicas" in out and "16 requests at 2" in out
    assert out.count(f"{sys.executable} -m no_such_module") == 6
    assert out.count("  CUDA_VISIBLE_DEVICES=0 ") == 6
    assert out.count("  CUDA_VISIBLE_DEVICES=0 SGLANG_DDTREE_BUDGETS=off ") == 2  # ddtree-b32
    assert "--speculative-num-draft-tokens 33" in out and not list(tmp_path.glob("logs"))
    # a low-concurrency call may capture fewer graphs (faster start)
    assert serve_bench.main(["--config", str(cfg), "--dry-run", "--concurrency", "1,2",
                             "--cuda-graph-max-bs", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("--cuda-graph-max-bs-decode 4") == 6 and "--max-running-requests 4" in out


def test_missing_paths_are_named_before_anything_starts(tmp_path, capsys):
    cfg = write_config(tmp_path, model_path=str(tmp_path / "no_model"))
    line = _error_line(capsys, ["--config", str(cfg), "--out", str(tmp_path / "o")])
    assert "no_model not found" in line and not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")
                                         if p.name != "evidence.yaml"))  # test_evidence.py
def test_shipped_configs_parse(name):
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.arms


def test_cost_projection():
    from ddtree_bench.cost_mode import projection

    rows = [dict(arm="no-spec", algorithm=None, budget=None, batch_size=1, step_ms=10.0),
            dict(arm="ddtree-b32", algorithm="DDTREE", budget=32, batch_size=1, step_ms=20.0)]
    out = projection(rows)
    assert out[1]["break_even_tau"] == 2.0 and out[1]["projected_speedup"] == round(8.71 / 2, 2)


def _cost_results(rows, command="run"):
    meta = dict(device="GPU", date="d", command=command, commit="c")
    return dict(meta=meta, cost_rows=rows, failures={})


def test_cost_runs_merge_and_report_needed_gain(tmp_path):
    """A cost run split over two calls merges into one table; DDTREE's needed gain over the
    chain is its step over DFLASH's at the same batch."""
    def row(arm, algo, budget, bs, ms):
        return dict(arm=arm, algorithm=algo, budget=budget, batch_size=bs, step_ms=ms, errors=0)
    first = _cost_results([row("no-spec", None, None, 1, 5.0), row("dflash", "DFLASH", None, 1, 8.0)])
    second = _cost_results([row("ddtree-b32", "DDTREE", 32, 1, 10.0)], command="run --arms ddtree-b32")
    second["failures"] = {"ddtree-b64": "boom"}
    for i, r in enumerate((first, second)):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "results.json").write_text(json.dumps(r))
    cfg = ROOT / "configs" / "h200_cost_qwen3_8b.yaml"
    assert serve_bench.main(["--config", str(cfg), "--out", str(tmp_path / "0"), "--report-only",
                             "--merge-from", str(tmp_path / "1")]) == 1  # a failure is reported
    merged = json.loads((tmp_path / "0" / "results.json").read_text())
    tree = next(r for r in merged["cost_rows"] if r["arm"] == "ddtree-b32")
    assert tree["break_even_tau"] == 2.0 and merged["failures"] == {"ddtree-b64": "boom"}
    assert merged["meta"]["merged_from"][0]["command"] == "run --arms ddtree-b32"
    md = (tmp_path / "0" / "results.md").read_text()
    assert "| 1 | 5.0 | 8.0 | 10.0 |" in md  # step-time pivot: batch, no-spec, dflash, ddtree
    assert "| 1 | 1.25 |" in md  # needed gain 10 / 8
    assert "PROJECTED" in md and "ddtree-b64: boom" in md
    assert serve_bench.main(["--config", str(cfg), "--out", str(tmp_path / "0"),
                             "--merge-from", str(tmp_path / "1")]) == 2
    # a folder without results.json: one clear line
    assert serve_bench.main(["--config", str(cfg), "--out", str(tmp_path / "0"), "--report-only",
                             "--merge-from", str(tmp_path / "nothing")]) == 2


def test_serving_run_split_by_concurrency_merges_and_judges_the_batch_aware_arm():
    """Calls that each measured every arm at some concurrency levels merge cell by cell (not
    arm by arm), rows of the later call carry its command, and the report sets ddtree-auto
    against the best other speculative arm at each level."""
    from ddtree_bench import report
    from ddtree_bench.run import merge_results

    def row(arm, algo, conc, tok_s):
        return dict(arm=arm, algorithm=algo, budget=None, concurrency=conc, output_tok_s=tok_s,
                    tpot_p50_ms=1, tpot_p90_ms=1, ttft_p50_ms=1, accept_length=None, errors=0)

    def results(rows, command):
        return dict(meta=dict(name="t", device="d", date="x", command=command, replicas=1,
                              max_new_tokens=8, temperature=0.0, reference_arm=None),
                    rows=rows, failures={})
    low = results([row("dflash", "DFLASH", 1, 100.0), row("ddtree-b32", "DDTREE", 1, 130.0),
                   row("ddtree-auto", "DDTREE", 1, 128.0), row("no-spec", None, 1, 500.0)],
                  "run --concurrency 1")
    high = results([row("dflash", "DFLASH", 8, 700.0), row("ddtree-b32", "DDTREE", 8, 600.0),
                    row("ddtree-auto", "DDTREE", 8, 650.0),
                    row("dflash", "DFLASH", 1, 999.0)],  # already in `low`: low's row stays
                   "run --concurrency 8")
    merged = merge_results(low, high)
    cells = {(r["arm"], r["concurrency"]): r for r in merged["rows"]}
    assert len(cells) == len(merged["rows"]) == 7
    assert cells[("dflash", 1)]["output_tok_s"] == 100.0
    assert cells[("ddtree-auto", 8)]["call"] == "run --concurrency 8"
    md = report.markdown(merged)
    assert "| 1 | 128.0 | ddtree-b32 | 130.0 | 0.985 | 1.280 | yes |  |  | this run |" in md
    assert ("| 8 | 650.0 | dflash | 700.0 | 0.929 | 0.929 | **no** |  |  | run --concurrency 8 |"
            in md)
    high["rows"][1]["steady_tok_s"], high["rows"][2]["steady_tok_s"] = 640.0, 660.0
    md = report.markdown(merge_results(low, high))  # steady state where measured
    assert "| **no** | 1.031 (ddtree-b32) |  | run --concurrency 8 |" in md
    assert report.budget_verdict(low["rows"][:2]) == []  # no ddtree-auto arm: no section


def test_interleaved_rounds_serve_one_request_list_every_arm_in_turn(monkeypatch):
    """A probe serves one wave per arm (the slowest sizes the list), then round r measures each
    arm once, starting at arm r mod n, each after its own warm-up, every measurement on the same
    list; rows keep the round order (times and rates) beside the sorted rates, and the log has
    one line per measurement."""
    from types import SimpleNamespace

    from ddtree_bench import cells
    from ddtree_bench.config import Arm

    events = []
    probe = {"a": 0.5, "b": 1.0, "c": 0.25}  # b is the slowest: 4 requests in 1 s

    def warm(cfg, urls, prompts, params, conc):
        events.append(("warm", urls[0]))
        return probe[urls[0]]

    monkeypatch.setattr(cells, "warm_up", warm)
    wall = iter([1.0, 2.0, 3.0, 1.2, 2.2, 3.2, 0.8, 1.8, 2.8]).__next__

    def fixed(cfg, urls, prompts, params, conc, n, logs):
        events.append(("measure", urls[0], n))
        w = wall()
        return dict(output_tok_s=100 / w, wall_s=w, output_tokens=100, requests=n, errors=0,
                    steady_tok_s=None), [urls[0]]

    monkeypatch.setattr(cells, "measure_fixed", fixed)
    cfg = SimpleNamespace(repeats=3, warmup_per_cell=True, cell_seconds=6.0)
    arms = [Arm(name=n, algorithm="DDTREE", budget=8) for n in "abc"]
    live = [(arm, [arm.name], []) for arm in arms]
    lines = []
    out = cells.measure_interleaved(cfg, live, [], {}, 4, log=lines.append)
    assert events[:3] == [("warm", "a"), ("warm", "b"), ("warm", "c")]  # the probe
    measured = [e for e in events if e[0] == "measure"]
    assert [e[1] for e in measured] == list("abc" "bca" "cab")
    assert {e[2] for e in measured} == {24}  # 6 s at b's 4 requests / s, whole waves of 4
    assert events[3:5] == [("warm", "a"), ("measure", "a", 24)]  # a warm-up before each
    rows = {row["arm"]: row for _, row in out}
    # arm a took 1.0 s (round 1), 3.2 s (round 2, third in turn), 1.8 s (round 3, second)
    assert rows["a"]["rounds_wall_s"] == [1.0, 3.2, 1.8]
    assert rows["a"]["rounds_tok_s"] == [100.0, 100 / 3.2, 100 / 1.8]
    assert rows["a"]["runs_tok_s"] == sorted(rows["a"]["rounds_tok_s"])
    assert [row["arm"] for _, row in out] == ["a", "b", "c"]
    assert len(lines) == 9 and all("requests" in x and " s " in x and "tok/s" in x
                                   for x in lines)
    assert lines[0].startswith("a ") and "c=4" in lines[0] and "round 1/3" in lines[0]


def test_a_fixed_work_list_is_sized_so_the_slowest_arm_needs_the_cell_seconds():
    from ddtree_bench.cells import size_requests

    # waves of 64: the slowest probe took 2 s (32 requests / s); 6 s = 192 requests
    assert size_requests(6.0, 64, [0.5, 2.0, 1.0]) == 192
    assert size_requests(6.0, 64, [2.1]) == 192  # 182.9 rounded up to whole waves
    assert size_requests(4.0, 1, [0.25]) == 16  # c = 1: one request a wave
    assert size_requests(4.0, 8, [30.0]) == 8  # never less than one wave


def test_round_ratios_pair_the_arms_of_each_round():
    from ddtree_bench import report

    def row(arm, rounds, call=None):
        r = dict(arm=arm, algorithm="DDTREE", concurrency=4, rounds_tok_s=rounds,
                 output_tok_s=sorted(rounds)[1])
        return dict(r, call=call) if call else r

    auto = row("ddtree-auto", [100.0, 90.0, 120.0])
    others = [row("ddtree-b32", [95.0, 100.0, 110.0]), row("dflash", [50.0, 80.0, 125.0])]
    # per round: 100/95, 90/100, 120/125
    assert report._round_ratios(auto, others) == "0.960 (0.900-1.053)"
    assert report._round_ratios(auto, [row("ddtree-b32", [1.0, 2.0, 3.0], "other call")]) == ""
    assert report._round_ratios(dict(auto, rounds_tok_s=None), others) == ""


def test_interleaved_serving_run_end_to_end(tmp_path, fake_env):
    out = tmp_path / "res"
    cfg = write_config(tmp_path, gpus=[0], startup_group=3, max_total_tokens=65536,
                       concurrency=[2], repeats=2, warmup_per_cell=True, interleave=True,
                       arms=[{"name": "dflash", "algorithm": "DFLASH"},
                             {"name": "ddtree-b32", "algorithm": "DDTREE", "budget": 32},
                             {"name": "ddtree-auto", "algorithm": "DDTREE", "budget": 32}])
    assert serve_bench.main(["--config", str(cfg), "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [r["arm"] for r in res["rows"]] == ["dflash", "ddtree-b32", "ddtree-auto"]
    assert all(len(r["rounds_tok_s"]) == 2 and r["errors"] == 0 for r in res["rows"])
    verdict = next(line for line in (out / "results.md").read_text().splitlines()
                   if line.startswith("| 2 |"))
    assert re.search(r"\| \d\.\d{3} \(\d\.\d{3}-\d\.\d{3}\) \| this run \|$", verdict)


def test_cost_mode_checkpoints_load_strictly(tmp_path):
    """The random-weight writer produces the names transformers and the DFlash loader expect
    (checked at a tiny size with the 8B configs' structure)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ddtree_bench.cost_mode import DRAFTER_8B, QWEN3_8B, write_random_models
    from ddtree_sglang.reference.drafter import DFlashDrafter

    small = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=300)
    tcfg = {**QWEN3_8B, **small, "num_hidden_layers": 4}
    dcfg = {**DRAFTER_8B, **small, "num_hidden_layers": 2, "num_target_layers": 4,
            "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": 299}}
    target, drafter = write_random_models(tmp_path, "cpu", tcfg, dcfg)
    model, info = AutoModelForCausalLM.from_pretrained(target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    d = DFlashDrafter.from_pretrained(drafter)  # strict: raises on any name mismatch
    assert d.fc.weight.shape == (64, 128) and d.config.block_size == 16
    assert model.config.hidden_size == 64 and torch.isfinite(d.fc.weight.float()).all()


def test_cost_mode_arm_filter_is_checked(tmp_path):
    cfg = ROOT / "configs" / "h200_cost_qwen3_8b.yaml"
    assert serve_bench.main(["--config", str(cfg), "--out", str(tmp_path),
                             "--arms", "ddtree-b7"]) == 2
    names = [a.name for a in serve_bench.cost_arms(load_config(cfg))]
    assert names == ["no-spec", "dflash", "ddtree-b15", "ddtree-b31", "ddtree-b63",
                     "ddtree-b127", "ddtree-b255"]
    verdict = serve_bench.cost_arms(load_config(ROOT / "configs" / "cost_verdict_qwen3_8b.yaml"))
    assert [(a.name, a.attention_backend) for a in verdict[:3]] == [
        ("no-spec", None), ("dflash", None), ("dflash-flashinfer", "flashinfer")]


def test_arm_environment_is_checked_and_reaches_the_server():
    from ddtree_bench.config import Arm, CostMode

    cfg = load_config(ROOT / "configs" / "h200_profile_qwen3_8b.yaml")
    single = [a for a in serve_bench.cost_arms(cfg) if a.name.endswith("-single")]
    assert [(a.budget, a.env) for a in single] == [
        (15, {"SGLANG_DDTREE_DEBUG": "sglang_attention"})]
    spec = serve_bench.server_spec(cfg, single[0], "m", "d")
    # a fixed-budget arm pins the budget (the server's default is the batch-aware choice)
    assert spec.env == {"SGLANG_DDTREE_DEBUG": "sglang_attention", "SGLANG_DDTREE_BUDGETS": "off"}
    for env, message in [({"SGLANG_DDTREE_DEBUG": "fast"}, "accepted: a comma list of"),
                         ({"SGLANG_DDTREE_VERIFY_ATTENTION": "kernel"}, "it was retired"),
                         ({"FOO": "1"}, "unknown setting 'FOO'")]:
        with pytest.raises(ValueError, match=message):
            Arm(name="x", algorithm="DDTREE", budget=15, env=env)
    with pytest.raises(ValueError, match="DDTREE arms only"):
        Arm(name="x", algorithm="DFLASH", env={"SGLANG_DDTREE_DEBUG": "torch_tree"})
    with pytest.raises(ValueError, match=">= 1"):
        CostMode(single_attention_budgets=[0])


def test_cost_mode_env_reaches_every_ddtree_arm():
    from ddtree_bench.config import CostMode

    cfg = load_config(ROOT / "configs" / "h200_profile_wide_qwen3_8b.yaml")
    arms = {a.name: a for a in serve_bench.cost_arms(cfg)}
    assert arms["ddtree-b127"].env == {"SGLANG_DDTREE_DEBUG": "host_timing"}
    assert arms["dflash"].env == {} and arms["no-spec"].env == {}
    with pytest.raises(ValueError, match="SGLANG_DDTREE_GRAMMAR='fast' is not accepted"):
        CostMode(env={"SGLANG_DDTREE_GRAMMAR": "fast"})


def test_comma_list_arguments():
    import argparse

    from ddtree_sglang.cli import positive_int_list

    assert positive_int_list("1,4,16") == [1, 4, 16]
    for bad in ("", "1,x", "-2"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated"):
            positive_int_list(bad)
    with pytest.raises(SystemExit):
        serve_bench.main(["--config", str(ROOT / "configs" / "h200_testbed.yaml"),
                          "--out", "/tmp/x", "--concurrency", "4,four"])


def test_profile_stages_name_the_tree_attention_kernel_and_flashinfer_norms():
    """DDTREE's own verify attention counts as attention; FlashInfer's fused RMSNorm (named
    flashinfer::norm::...) as a norm, not as attention (profiles before 2026-12-04 did)."""
    from ddtree_bench.profile import stage_of

    assert stage_of("_prefix_kernel") == stage_of("_tree_merge_kernel") == "attention"
    assert stage_of("_fwd_kernel") == "attention"
    assert stage_of("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>") == "norms"
    assert stage_of("fused_qknorm_warp<128l>") == "norms"
    assert stage_of("_tree_kernel") == "tree (fused kernel)"


def test_profile_kernel_table_from_a_trace(tmp_path):
    """Per-step kernel time, stage sums and the GPU idle time inside the profiled span."""
    import gzip

    from ddtree_bench import profile

    events = [  # two steps: [0, 10) gemm, [12, 15) attention; [20, 30) gemm, [25, 28) sort
        dict(ph="X", cat="kernel", name="nvjet_tst_128x256", ts=0, dur=10),
        dict(ph="X", cat="kernel", name="_fwd_kernel_stage1", ts=12, dur=3),
        dict(ph="X", cat="kernel", name="nvjet_tst_128x256", ts=20, dur=10),
        dict(ph="X", cat="kernel", name="at::native::sort_kernel", ts=25, dur=3),
        dict(ph="X", cat="cpu_op", name="aten::mm", ts=0, dur=100),  # host side: not counted
        # host waits: two syncs and one pageable copy in the window; a launch is not a wait
        dict(ph="X", cat="cuda_runtime", name="cudaStreamSynchronize", ts=16, dur=4),
        dict(ph="X", cat="cuda_runtime", name="cudaStreamSynchronize", ts=31, dur=2),
        dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=19, dur=1),
        dict(ph="X", cat="cuda_runtime", name="cudaMemcpyAsync", ts=15, dur=1),
        dict(ph="X", cat="gpu_memcpy", name="Memcpy HtoD (Pageable -> Device)", ts=16, dur=1),
    ]
    path = tmp_path / "x.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    table = profile.kernel_table(profile.read_trace(path), steps=2)
    assert table["span_ms"] == 0.015 and table["busy_ms"] == 0.012
    assert table["idle_ms"] == 0.003  # 1 us before the copy, 1 after, 1 before the third kernel
    assert table["stages"] == {"gemm": 0.01, "attention": 0.0015, "sort / top-k": 0.0015,
                               "copies": 0.0005}
    assert table["host_waits"] == {
        "recorded": True, "calls": {"cudaStreamSynchronize": {"calls": 1.0, "ms": 0.003}},
        "pageable_copies": 0.5}
    kernels_only = profile.kernel_table([e for e in events if e["cat"] != "cuda_runtime"], 2)
    assert kernels_only["host_waits"]["recorded"] is False
    assert "runtime calls not in the trace" in profile.markdown({"a@1": kernels_only}, "# t")
    assert table["kernels"][0] == dict(name="nvjet_tst_128x256", stage="gemm", calls=1.0, ms=0.01)
    md = profile.markdown({"dflash@1": table}, "# t")
    assert "GPU idle inside the span" in md and "`nvjet_tst_128x256`" in md
    assert "cudaStreamSynchronize 1.0 (0.003 ms); pageable copies 0.5" in md
    with pytest.raises(ValueError, match="no GPU kernels"):
        profile.kernel_table([e for e in events if e["cat"] != "kernel"
                              and e["cat"] != "gpu_memcpy"], steps=1)


def test_budget_projection_picks_the_best_rate_per_batch(tmp_path, capsys):
    from ddtree_bench import projection

    rows = [dict(arm="dflash", batch_size=1, step_ms=8.0), dict(arm="dflash", batch_size=8, step_ms=10.0),
            dict(arm="ddtree-b16", batch_size=1, step_ms=9.0),
            dict(arm="ddtree-b16", batch_size=8, step_ms=12.0),
            dict(arm="ddtree-b64", batch_size=1, step_ms=9.5),
            dict(arm="ddtree-b64", batch_size=8, step_ms=30.0)]
    tau = {16: 8.0, 64: 10.0}
    out = {r["batch_size"]: r for r in projection.project(rows, tau, chain_tau=7.0)}
    assert out[1]["chosen_budget"] == 64 and out[8]["chosen_budget"] == 16
    assert out[1]["projected_ratio"] == round((10.0 / 9.5) / (7.0 / 8.0), 3)
    assert out[8]["projected_ratio"] == round((8.0 / 12.0) / (7.0 / 10.0), 3)
    assert "PROJECTION (not a measurement)" in projection.markdown(list(out.values()), "x.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert projection.main(["--cost", str(bad)]) == 2
    assert "not a readable cost-mode results.json" in capsys.readouterr().err


def test_budget_projection_joins_cost_runs_by_ratio_and_interpolates_tau(tmp_path, capsys):
    """Two calls, each with its own DFLASH: DDTREE steps rescaled to the first call's DFLASH;
    only the asked-for variant's arms; unpublished budgets get a log-linear accept length."""
    from ddtree_bench import projection

    first = [dict(arm="dflash", batch_size=1, step_ms=8.0),
             dict(arm="ddtree-b15-kernel", batch_size=1, step_ms=7.6),
             dict(arm="ddtree-b15-single", batch_size=1, step_ms=9.0)]
    second = [dict(arm="dflash", batch_size=1, step_ms=10.0),
              dict(arm="ddtree-b128-kernel", batch_size=1, step_ms=10.0)]
    rows = projection.join_cost_runs([first, second], ["kernel"])
    assert sorted((r["arm"], r["step_ms"]) for r in rows) == [
        ("ddtree-b128", 8.0), ("ddtree-b15", 7.6), ("dflash", 8.0)]
    # several variants: plain arms ("default") and -kernel ones; the first row of a budget wins
    third = [dict(arm="dflash", batch_size=1, step_ms=5.0),
             dict(arm="ddtree-b15", batch_size=1, step_ms=4.0),
             dict(arm="ddtree-b127", batch_size=1, step_ms=6.0)]
    both = projection.join_cost_runs([first, third], ["kernel", "default"])
    assert sorted((r["arm"], r["step_ms"]) for r in both) == [
        ("ddtree-b127", 9.6), ("ddtree-b15", 7.6), ("dflash", 8.0)]
    assert [r["arm"] for r in projection.join_cost_runs([first])] == ["dflash"]  # default only
    assert projection.paper_tau(128) == 10.2
    assert projection.paper_tau(15) == round(8.6 + (9.3 - 8.6) * math.log2(15 / 16), 3)
    assert projection.paper_tau(90) == round(9.75 + 0.45 * math.log2(90 / 64), 3)
    assert projection.paper_tau(1024) is None
    out = projection.project(rows)[0]
    assert out["tau"] == {15: projection.paper_tau(15), 128: 10.2}
    assert out["chosen_budget"] == 128  # 10.2 / 8.0 > 8.535 / 7.6
    assert "B=15: 8.535" in projection.markdown([out], "a.json")
    paths = []
    for i, run in enumerate((first, second)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps({"cost_rows": run}))
    assert projection.main(["--cost", *map(str, paths), "--variant", "kernel"]) == 0
    assert "| 1 | 128 |" in capsys.readouterr().out
    assert projection.main(["--cost", str(paths[1]), "--variant", "split"]) == 2
    assert "no batch size has both" in capsys.readouterr().err


def test_cells_repeat_and_run_to_their_minimum(tmp_path, fake_env):
    """Warm-up per cell, a sustained load until the minimum number of requests, three
    measurements with the median in the row and the spread reported."""
    out = tmp_path / "res"
    cfg = write_config(tmp_path, gpus=[0], arms=[{"name": "dflash", "algorithm": "DFLASH"}],
                       concurrency=[2], requests_per_level=4, min_cell_requests=10, repeats=3,
                       warmup_per_cell=True)
    assert serve_bench.main(["--config", str(cfg), "--out", str(out)]) == 0
    row = json.loads((out / "results.json").read_text())["rows"][0]
    assert row["requests"] == 10  # sent until 10, two in flight throughout
    assert len(row["runs_tok_s"]) == 3 and sorted(row["runs_tok_s"])[1] == row["output_tok_s"]
    assert len(row["runs_steady_tok_s"]) == 3
    assert row["spread"] is not None and row["spread"] >= 0
    assert "| spread |" in (out / "results.md").read_text()


def test_sustained_load_keeps_the_concurrency_until_done():
    from ddtree_bench import client

    state = dict(now=0, peak=0)
    lock = __import__("threading").Lock()

    def fake_send(url, ids, params):
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        time.sleep(0.01)
        with lock:
            state["now"] -= 1
        return [1, 2, 3], 0.002, 0.01, {}

    old = client.ENDPOINTS["native"]
    client.ENDPOINTS["native"] = fake_send
    try:
        res, wall, drain_at = client.run_sustained(["u"], [[1]], {}, 3, lambda s, k: k >= 20)
    finally:
        client.ENDPOINTS["native"] = old
    assert len(res) == 20 and state["peak"] == 3 and 0 < drain_at <= wall
    assert sorted(r.prompt_index for r in res) == [0] * 20


def test_steady_rate_counts_tokens_inside_the_full_load_window():
    from ddtree_bench.client import RequestResult, steady_tok_s

    def req(sent, ttft, latency, n):
        return RequestResult(replica=0, prompt_index=0, output_ids=[0] * n, ttft=ttft,
                             latency=latency, sent_at=sent)

    # two in flight; both stream from t = 1; 11 tokens each over [1, 11] (first + 10 more)
    rs = [req(0.0, 1.0, 11.0, 11), req(0.0, 1.0, 11.0, 11)]
    # window [1, 6]: two first tokens + half of each one's other 10 tokens = 12 tokens in 5 s
    assert steady_tok_s(rs, 2, 6.0) == 2.4
    assert steady_tok_s(rs, 2, 1.0) is None  # no full-load window
    assert steady_tok_s(rs[:1], 2, 6.0) is None  # fewer requests than in flight


def test_cell_minimums():
    def cfg(**kw):
        return BenchConfig(name="x", arms=[{"name": "a"}], **kw)

    assert serve_bench.cell_done(cfg(), 0.1, 8)  # no minimum: one round
    assert not serve_bench.cell_done(cfg(min_cell_seconds=30), 5.0, 1000)
    assert serve_bench.cell_done(cfg(min_cell_seconds=30), 31.0, 8)
    # time bounds a cell: a request count extends it, never ends it early
    assert not serve_bench.cell_done(cfg(min_cell_seconds=30, min_cell_requests=256), 5.0, 256)
    assert not serve_bench.cell_done(cfg(min_cell_seconds=30, min_cell_requests=256), 31.0, 255)
    assert serve_bench.cell_done(cfg(min_cell_seconds=30, min_cell_requests=256), 31.0, 256)
    assert not serve_bench.cell_done(cfg(min_cell_requests=256), 100.0, 255)


def test_repeated_cost_cells_report_median_and_spread():
    from ddtree_bench.client import RequestResult
    from ddtree_bench.cost_mode import repeated_step_ms

    def level(ms_per_step: float) -> list[RequestResult]:  # 10 decode steps after the first token
        return [RequestResult(0, 0, output_ids=list(range(11)), ttft=0.0, latency=ms_per_step / 100)]

    once = repeated_step_ms([level(8.0)])
    assert once == {"step_ms": 8.0}
    three = repeated_step_ms([level(9.0), level(8.0), level(10.0)])
    assert three == {"step_ms": 9.0, "runs_ms": [9.0, 8.0, 10.0], "spread": 0.222}
    failed = [RequestResult(0, 0, error="boom")]
    assert repeated_step_ms([failed, level(8.0)])["step_ms"] == 8.0
    assert repeated_step_ms([failed]) == {"step_ms": None}


def test_results_are_saved_after_every_level(tmp_path, fake_env):
    """A run cut short by its time limit keeps every level it finished (all arms of a group
    start together, so saving per group would keep nothing until the group ends)."""
    cfg = load_config(write_config(tmp_path, gpus=[0], startup_group=2, max_total_tokens=65536,
                                   concurrency=[1, 2], interleave=True,
                                   arms=[{"name": "dflash", "algorithm": "DFLASH"},
                                         {"name": "ddtree-b32", "algorithm": "DDTREE",
                                          "budget": 32}]))
    saved = []
    serve_bench.run_throughput(cfg, tmp_path / "out", "cmd",
                               save=lambda r: saved.append([(x["arm"], x["concurrency"])
                                                            for x in r["rows"]]))
    assert saved[0] == [("dflash", 1), ("ddtree-b32", 1)]  # after the first level
    assert saved[-1] == [("dflash", 1), ("dflash", 2), ("ddtree-b32", 1), ("ddtree-b32", 2)]


def test_dry_run_names_missing_inputs_and_the_real_run_refuses_them(tmp_path, capsys):
    cfg = write_config(tmp_path, model_path=str(tmp_path / "no-such-model"))
    assert serve_bench.main(["--config", str(cfg), "--dry-run"]) == 0
    assert "no-such-model: NOT FOUND here" in capsys.readouterr().out
    line = _error_line(capsys, ["--config", str(cfg), "--out", str(tmp_path / "out")])
    assert "no-such-model not found (check the path" in line  # absolute: no cwd hint
    assert not (tmp_path / "out").exists()


def test_pro6000x8_config_plans_on_any_machine_by_hub_id(capsys, monkeypatch, tmp_path):
    """configs/pro6000x8_real.yaml names the models by hub ID; its dry-run prints the plan here
    (no GPU, nothing cached) and says the servers would download them; offline and uncached, the
    real run is refused naming what to fetch."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    cfg = ROOT / "configs" / "pro6000x8_real.yaml"
    assert serve_bench.main(["--config", str(cfg), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "7 arms x 8 replicas / 4 replicas of tp 2" in out
    assert "target Qwen/Qwen3-8B: hub ID, not cached: the server downloads it" in out
    assert "drafter z-lab/Qwen3-8B-DFlash-b16: hub ID" in out
    assert out.count("--model-path Qwen/Qwen3-8B ") == 5 * 8 + 2 * 4  # tp 1 and tp 2 replicas
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    line = _error_line(capsys, ["--config", str(cfg), "--out", str(tmp_path / "o")])
    assert "hf download Qwen/Qwen3-8B" in line and "HF_HUB_OFFLINE is set" in line


def test_a_run_without_a_usable_gpu_stops_before_starting_servers(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = write_config(tmp_path, launcher_module="sglang.launch_server")
    line = _error_line(capsys, ["--config", str(cfg), "--out", str(tmp_path / "out")])
    assert "need 1 CUDA GPU(s)" in line and "no usable CUDA GPU" in line
    assert "nothing was started" in line and not (tmp_path / "out").exists()
    assert serve_bench.main(["--config", str(cfg), "--dry-run"]) == 0  # the plan needs no GPU


def test_arms_know_tp_and_page_size_and_the_8_gpu_config_plans_tp2_pairs(tmp_path, capsys):
    """A tp arm runs one replica per group of tp GPUs (CUDA_VISIBLE_DEVICES=0,1 ...) with
    --tp-size; an arm's page size overrides the config's; a tp that does not divide the GPUs
    is refused.  configs/pro6000x8_real.yaml prints eight tp = 1 replicas and four tp = 2
    pairs."""
    from ddtree_bench.config import ConfigError, load_config, replica_gpus

    assert replica_gpus([0, 1, 2, 3], 2) == ["0,1", "2,3"] and replica_gpus([5], 1) == ["5"]
    cfg = load_config(write_config(tmp_path, gpus=[0, 1, 2, 3], arms=[
        {"name": "dflash", "algorithm": "DFLASH", "tp": 2, "page_size": 16}]))
    from ddtree_bench.run import server_spec

    spec = server_spec(cfg, cfg.arms[0], "m", "d")
    argv = spec.cli(0)
    assert argv[argv.index("--tp-size") + 1] == "2" and argv[argv.index("--page-size") + 1] == "16"
    with pytest.raises(ConfigError, match="their tp does not divide the 3 gpus"):
        load_config(write_config(tmp_path, gpus=[0, 1, 2], arms=[{"name": "a", "tp": 2}]))
    assert serve_bench.main(["--config", str(ROOT / "configs" / "pro6000x8_real.yaml"),
                             "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("[ddtree-b31-tp2, GPU ") == 4 and "[ddtree-b31-tp2, GPU 6,7]" in out
    assert out.count("[ddtree-b15, GPU ") == 8
    lines = out.splitlines()
    pair = lines[lines.index("  # [dflash-tp2, GPU 2,3]") + 1]
    assert pair.startswith("  CUDA_VISIBLE_DEVICES=2,3 ") and "--tp-size 2" in pair
