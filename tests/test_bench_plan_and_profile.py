"""The harness's plan (`ddtree-bench --dry-run`: commands that run as printed, the expected
duration), fixed-work cells of arms measured one after another, the decode-step profile
(a trace reduced to launches per step; a profile-only serving config end to end against the
stand-in server) and the servers' clean-up on a shared machine (only the groups a run
recorded are stopped)."""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from test_bench import write_config as bench_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the stand-in server module

from ddtree_bench import profile  # noqa: E402
from ddtree_bench import run as serve_bench  # noqa: E402
from ddtree_bench.server import PIDS_ENV, Server, ServerSpec, stop_recorded  # noqa: E402

PYTHONPATH = f"{ROOT / 'tests'}:{ROOT / 'src'}:{ROOT / 'benchmarks'}"


def write_config(tmp_path: Path, **overrides) -> Path:
    """test_bench's stand-in config on one GPU, a DFLASH arm and a DDTREE arm with a knob."""
    arms = [{"name": "dflash", "algorithm": "DFLASH"},
            {"name": "ddtree-b15", "algorithm": "DDTREE", "budget": 15,
             "env": {"SGLANG_DDTREE_GRAMMAR": "auto"}}]
    return bench_config(tmp_path, **{"gpus": [0], "arms": arms, **overrides})


@pytest.fixture
def fake_env(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", PYTHONPATH)


def _commands(out: str) -> list[tuple[str, str]]:
    """(the `# [arm, GPU g]` comment, the command line after it) of a dry-run's output."""
    lines = out.splitlines()
    return [(lines[i].strip(), lines[i + 1].strip()) for i, x in enumerate(lines)
            if x.startswith("  # [")]


def _wait_healthy(port: int, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing healthy on port {port}")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_dry_run_commands_run_as_printed_with_their_environment(tmp_path, capsys, fake_env):
    """Every printed launch carries the arm's knobs (a budget pins SGLANG_DDTREE_BUDGETS=off)
    and its GPUs as env assignments, shell-quoted; pasted into a shell, a printed line starts
    a server that sees exactly that environment."""
    cfg = write_config(tmp_path, gpus=[0, 1])
    assert serve_bench.main(["--config", str(cfg), "--dry-run"]) == 0
    commands = _commands(capsys.readouterr().out)
    assert [c for c, _ in commands] == ["# [dflash, GPU 0]", "# [dflash, GPU 1]",
                                        "# [ddtree-b15, GPU 0]", "# [ddtree-b15, GPU 1]"]
    words = shlex.split(commands[3][1])
    assert words[:3] == ["CUDA_VISIBLE_DEVICES=1", "SGLANG_DDTREE_BUDGETS=off",
                         "SGLANG_DDTREE_GRAMMAR=auto"]
    assert words[3:6] == [sys.executable, "-m", "fake_sglang_server"]
    assert words[words.index("--port") + 1] == "30003"  # one port per printed server
    assert words[words.index("--speculative-num-draft-tokens") + 1] == "16"
    line = commands[3][1]
    assert _port_free(30003), "port 30003 is taken here; the printed command cannot run"
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(line, shell=True, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait_healthy(30003)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    env_line = next(x for x in log.read_text().splitlines() if x.startswith("env:"))
    assert env_line == ("env: CUDA_VISIBLE_DEVICES=1 SGLANG_DDTREE_BUDGETS=off "
                        "SGLANG_DDTREE_GRAMMAR=auto")


def test_a_quoted_value_survives_the_shell():
    spec = ServerSpec(model_path="/models/my target", name="x",
                      env={"SGLANG_DDTREE_BUDGETS": "7,15"})
    words = shlex.split(spec.shell_command(30000, "0,1"))
    assert words[:2] == ["CUDA_VISIBLE_DEVICES=0,1", "SGLANG_DDTREE_BUDGETS=7,15"]
    assert words[words.index("--model-path") + 1] == "/models/my target"


def test_the_plan_states_its_expected_duration(tmp_path, capsys):
    """startup groups x startup_seconds + levels x arms x (rounds x (cell s + 1.5) + 1.5) +
    profiles; a plan whose cells are a bare request count says what it cannot know."""
    cfg = write_config(tmp_path, startup_group=2, max_total_tokens=65536, interleave=True,
                       cell_seconds=6, repeats=2, startup_seconds=150,
                       profile={"batches": [1, 64]})
    assert serve_bench.main(["--config", str(cfg), "--dry-run"]) == 0
    out = capsys.readouterr().out
    # 150 + 2 levels x 2 arms x (2 x 7.5 + 1.5) + 2 arms x 2 batches x 2 recordings x 10 s
    assert "expected duration: ~4.9 min (296 s: startup 1 group x 150 s; 2 levels x 2 arms x " \
           "(2 x (6 s + 1.5 s) + 1.5 s); 8 profiles x 10 s)" in out
    assert "profiles: every arm at batch [1, 64], 20 decode steps each, again with the host " \
           "recorded for its launches" in out
    assert "sized from a probe so a measurement takes about 6 s, x2 in interleaved rounds" in out
    cfg = write_config(tmp_path)  # 12 requests at 1, 16 at 4: time unknown before measuring
    assert serve_bench.main(["--config", str(cfg), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "expected duration: at least ~6.0 min (360 s: startup 2 groups x 180 s; 2 levels " \
           "of fixed request counts, at the arms' speed)" in out


def test_the_8_gpu_plan_prints_runnable_tp2_commands_and_its_duration(capsys, monkeypatch,
                                                                      tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert serve_bench.main(["--config", str(ROOT / "configs" / "pro6000x8_real.yaml"),
                             "--dry-run"]) == 0
    out = capsys.readouterr().out
    commands = dict(_commands(out))
    tp2 = shlex.split(commands["# [ddtree-b31-tp2, GPU 6,7]"])
    assert tp2[:3] == ["CUDA_VISIBLE_DEVICES=6,7", "SGLANG_DDTREE_BUDGETS=off",
                       "SGLANG_DDTREE_DEBUG=unchecked"]
    assert tp2[3:6] == [sys.executable, "-m", "sglang.launch_server"]
    assert tp2[tp2.index("--tp-size") + 1] == "2"
    ports = [shlex.split(c)[shlex.split(c).index("--port") + 1] for c in commands.values()]
    assert len(set(ports)) == len(ports) == 5 * 8 + 2 * 4
    # 7 arms one by one: 7 x 240 s; 7 levels x 7 arms x (8 + 1.5 + 1.5) s
    assert "expected duration: ~37.0 min (2219 s: startup 7 groups x 240 s; 7 levels x 7 arms" \
           " x (1 x (8 s + 1.5 s) + 1.5 s))" in out


def test_arms_measured_one_after_another_serve_the_list_the_first_arm_sized(tmp_path,
                                                                             fake_env):
    """cell_seconds without interleave: at each level the first arm's probe sizes the list and
    every later arm (another startup group) serves the same requests."""
    out = tmp_path / "res"
    cfg = write_config(tmp_path, cell_seconds=0.2, concurrency=[2],
                       arms=[{"name": "dflash", "algorithm": "DFLASH"},
                             {"name": "ddtree-b15", "algorithm": "DDTREE", "budget": 15}])
    assert serve_bench.main(["--config", str(cfg), "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["arm"] for r in rows] == ["dflash", "ddtree-b15"]
    assert rows[0]["requests"] == rows[1]["requests"] >= 2
    assert rows[0]["output_tokens"] == rows[1]["output_tokens"] == rows[0]["requests"] * 12


def test_launches_per_step_from_the_hosts_runtime_and_driver_calls():
    """Kernels launched outside graphs through the runtime or the driver API (Triton), graph
    replays, async copies and sets, per profiled step; a trace of the GPU only has no calls."""
    from fake_sglang_server import fake_trace

    events = fake_trace(4, ["CPU", "GPU"], eager=3)
    counts = profile.launch_counts(events, steps=4)
    assert counts["recorded"] is True
    assert (counts["eager"], counts["graph"], counts["memcpy"], counts["memset"]) == (
        3.0, 1.0, 1.0, 0.0)
    assert counts["calls"] == {"cuLaunchKernel": 1.0, "cudaGraphLaunch": 1.0,
                               "cudaLaunchKernel": 2.0, "cudaMemcpyAsync": 1.0}
    gpu_only = profile.launch_counts(fake_trace(4, ["GPU"], eager=3), steps=4)
    assert gpu_only["recorded"] is False and gpu_only["eager"] == 0.0
    table = profile.kernel_table(events, steps=4)
    # per 100 us step: 30 + 20 us in the graph, 3 x 4 us eager kernels from 60 us on
    assert table["span_ms"] == round((300 + 74) * 1e-3 / 4, 4)
    assert table["busy_ms"] == 0.062
    md = profile.markdown({"ddtree@1": dict(table, launches=counts)}, "# t")
    assert "| **kernel launches outside CUDA graphs** (per step) | 3.0 |" in md
    assert "| CUDA graph replays (per step) | 1.0 |" in md


def test_a_profile_only_serving_config_end_to_end(tmp_path, fake_env):
    """configs like testbed_profile.yaml: no throughput cells, every arm profiled at each batch
    once its requests stream, twice (GPU only; with the host for the launches); profile.md
    holds the table."""
    out = tmp_path / "res"
    cfg = write_config(tmp_path, concurrency=[], startup_group=2, max_total_tokens=65536,
                       profile={"batches": [2], "steps": 5, "new_tokens": 16})
    assert serve_bench.main(["--config", str(cfg), "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["rows"] == [] and res["failures"] == {}
    assert set(res["profiles"]) == {"dflash@2", "ddtree-b15@2"}
    tree = res["profiles"]["ddtree-b15@2"]
    assert tree["launches"]["eager"] == 3.0 and tree["launches"]["graph"] == 1.0
    assert res["profiles"]["dflash@2"]["launches"]["eager"] == 1.0
    assert tree["steps"] == 5 and tree["kernels"][0]["name"] == "nvjet_tst_128x256"
    md = (out / "profile.md").read_text()
    assert "kernel launches outside CUDA graphs" in md and "ddtree-b15@2" in md
    for rec in ("gpu", "cpu"):
        assert (out / "traces" / "ddtree-b15@2" / rec / "fake-TP-0.trace.json.gz").is_file()


# What a scheduler's host sampler writes (ddtree_bench/host_sampler.py), less its steps:
# 70 samples over a 70 ms window
HOST_SAMPLES = {
    "interval_ms": 1.0, "window_ms": 70.0, "samples": 70, "sampler_ms": 1.4,
    "stages": {"run_batch > ddtree_verify": 40, "process_batch_result": 30},
    "self": {"ddtree_sglang/sglang_plugin/decode_step.py:DecodeStep.verify": {"samples": 40,
                                                                              "line": 210},
             "managers/scheduler.py:Scheduler.process_batch_result": {"samples": 30,
                                                                      "line": 95}},
    "cumulative": {"managers/scheduler.py:Scheduler.run_batch": 40,
                   "managers/scheduler.py:Scheduler.process_batch_result": 30}}


def test_host_samples_add_a_host_table_per_cell_side_by_side(tmp_path, fake_env, monkeypatch,
                                                            capsys):
    """profile.host_samples: every server starts with DDTREE_BENCH_HOST_SAMPLES=1 (as the plan
    prints), a third recording per cell asks /start_profile for [HOST_SAMPLES] over host_steps
    steps and reads the samples file the scheduler writes (here written where the stand-in
    answers); results.json holds ms per step by stage and function, profile.md puts the
    cells of a batch side by side.  A cell whose server sampled nothing says so."""
    from ddtree_bench import host_sampler

    cfg = write_config(tmp_path, concurrency=[], startup_group=2, max_total_tokens=65536,
                       profile={"batches": [2], "steps": 5, "new_tokens": 16, "launches": False,
                                "host_samples": True, "host_steps": 7})
    assert serve_bench.main(["--config", str(cfg), "--dry-run"]) == 0
    commands = _commands(capsys.readouterr().out)
    assert commands and all(f"{host_sampler.ENV}=1" in shlex.split(line) for _, line in commands)
    asked, real = [], profile.start_profile

    def start_profile(url, out_dir, steps, activities=("GPU",)):
        real(url, out_dir, steps, activities)
        asked.append((list(activities), steps))
        if host_sampler.ACTIVITY in activities:  # the scheduler's sampler, after its steps
            (out_dir / "host-samples-TP-0.json").write_text(
                json.dumps(dict(HOST_SAMPLES, steps=steps)))

    monkeypatch.setattr(profile, "start_profile", start_profile)
    out = tmp_path / "res"
    assert serve_bench.main(["--config", str(cfg), "--out", str(out)]) == 0
    assert asked == [(["GPU"], 5), ([host_sampler.ACTIVITY], 7)] * 2
    res = json.loads((out / "results.json").read_text())
    assert res["failures"] == {}
    host = res["profiles"]["ddtree-b15@2"]["host"]
    assert host["steps"] == 7 and host["step_ms"] == 10.0 and host["sampler_ms"] == 0.2
    assert host["stages"] == {"run_batch > ddtree_verify": 5.7143, "process_batch_result": 4.2857}
    assert host["self"][0] == {"function": "ddtree_sglang/sglang_plugin/decode_step.py:"
                               "DecodeStep.verify", "line": 210, "ms": 5.7143}
    md = (out / "profile.md").read_text()
    assert "## host: where the scheduler's time goes per decode step" in md
    assert "| stage | dflash@2 | ddtree-b15@2 |" in md
    assert "| run_batch > ddtree_verify | 5.7143 | 5.7143 |" in md
    assert "| `managers/scheduler.py:Scheduler.process_batch_result` | 4.2857 (:95) | " in md
    failed = profile.host_markdown({"ddtree-b15@1": {"host_error": "TimeoutError: no file"}})
    assert "- ddtree-b15@1: no host samples: TimeoutError: no file" in failed


def test_a_load_that_ends_before_the_profiled_steps_is_named(tmp_path):
    with pytest.raises(RuntimeError, match="raise profile.new_tokens"):
        profile.wait_for_trace(tmp_path, timeout=5, given_up=lambda: True, grace=0.3)


def test_a_failed_request_is_the_profiles_error_and_no_profile_starts(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(OSError, match="refused"):
        profile.profile_under_load(url, [[1, 2]], {"max_new_tokens": 4}, 2, tmp_path / "t", 5,
                                   ["GPU"])
    assert not (tmp_path / "t").exists()


def test_only_the_servers_a_run_recorded_are_stopped(tmp_path, monkeypatch):
    """A launcher killed before it could stop its server leaves it running; stop_recorded (what
    scripts/gpu_run.sh runs on exit) stops the groups its record names and no other server on
    the machine."""
    record = tmp_path / "pids"
    orphan_script = textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = {PYTHONPATH.split(':')!r}
        from pathlib import Path
        from ddtree_bench.server import Server, ServerSpec
        s = Server(ServerSpec(model_path="m", name="orphan", launcher_module="fake_sglang_server"),
                   Path({str(tmp_path / 'orphan.log')!r}))
        s.launch()
        s.wait_healthy(30)
        print(s.port, flush=True)
        os._exit(0)  # as SIGKILL would: no clean-up runs
    """)
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, **{PIDS_ENV: str(record)})
    port = int(subprocess.run([sys.executable, "-c", orphan_script], env=env, check=True,
                              capture_output=True, text=True, timeout=60).stdout.split()[-1])
    _wait_healthy(port, 5)  # still serving, its launcher gone
    monkeypatch.setenv("PYTHONPATH", PYTHONPATH)
    monkeypatch.delenv(PIDS_ENV, raising=False)
    other = Server(ServerSpec(model_path="m", name="someone-else",  # not this run's
                              launcher_module="fake_sglang_server"), tmp_path / "other.log")
    other.launch()
    try:
        other.wait_healthy(30)
        stopped = stop_recorded(record)
        assert len(stopped) == 1
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=2)
        assert other.alive()
        assert stop_recorded(record) == []  # nothing left to stop
    finally:
        other.stop()


def test_gpu_run_stops_its_own_servers_only():
    script = (ROOT / "scripts" / "gpu_run.sh").read_text()
    assert "pkill" not in script and "killall" not in script
    assert "python -m ddtree_bench.server stop-recorded" in script
    assert f"export {PIDS_ENV}" in script and "trap stop_own_servers EXIT" in script


def test_the_8b_serving_run_forces_each_arm_s_published_acceptance():
    """configs/pro6000x8.yaml serves the random 8B-shaped pair through the whole server: DFLASH
    gets SGLang's SGLANG_SIMULATE_ACC_LEN, each DDTREE arm its curve over budgets
    (SGLANG_DDTREE_SIMULATE_ACC) with its budgets left to the batch-aware choice; the printed
    commands name the random models and skip the tokenizer; a plain arm cannot take a forced
    acceptance, nor DFLASH a curve."""
    import pytest

    from ddtree_bench.config import Arm, load_config
    from ddtree_bench.dry_run import plan
    from ddtree_bench.run import arm_env

    cfg = load_config(ROOT / "configs" / "pro6000x8.yaml")
    env = {a.name: arm_env(a) for a in cfg.arms}
    assert env["dflash"] == {"SGLANG_SIMULATE_ACC_LEN": "7.79"}
    assert env["ddtree-default"] == {"SGLANG_DDTREE_SIMULATE_ACC":
                                     "7:6.0,15:8.5,16:8.6,32:9.3,64:9.75,128:10.2,256:10.4,512:10.7"}
    assert env["ddtree-with-0"]["SGLANG_DDTREE_BUDGETS"] == "0,7,15"
    text = plan(cfg, None)
    assert "qwen3_8b_random" in text and "--skip-tokenizer-init" in text
    assert "testbed/target" not in text
    with pytest.raises(ValueError, match="simulate_accept applies to DFLASH and DDTREE"):
        Arm(name="p", simulate_accept=4.0)
    with pytest.raises(ValueError, match="applies to DDTREE arms only"):
        Arm(name="d", algorithm="DFLASH", simulate_accept={7: 5.0})


def test_a_phase_exits_with_its_check_s_status_not_the_log_packing_s(tmp_path):
    """scripts/gpu_run.sh e2e: a check that fails (exit 3) makes the phase fail with 3, though
    the log packing after it succeeds (the evidence runner reads this status)."""
    import os
    import stat
    import subprocess

    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text("#!/usr/bin/env bash\n"
                    "case \"$1\" in tests/gpu/e2e_server.py) mkdir -p \"$OUT/e2e\"; exit 3;; "
                    "esac\nexit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               HOME=str(tmp_path))
    done = subprocess.run(["bash", "scripts/gpu_run.sh", "e2e"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
