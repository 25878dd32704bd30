"""The host sampler of the decode-step profile (benchmarks/ddtree_bench/host_sampler.py): on a
Python workload whose hot functions and stages are known it finds them in proportion (shares,
never times: the machine may be busy); the stages it reads from DDTREE's and DFLASH's sources;
its SGLang entry point does nothing without DDTREE_BENCH_HOST_SAMPLES or outside a scheduler
process; the profiler hooks write one window of steps that the harness reduces to its table."""

import json
import sys
import threading
import time
import tomllib
from contextlib import nullcontext
from pathlib import Path
from types import CodeType, ModuleType, SimpleNamespace

import pytest

from ddtree_bench import host_sampler, profile
from ddtree_bench.host_sampler import HostSampler, stage_lines

ROOT = Path(__file__).resolve().parents[1]
SGLANG = Path(__import__("importlib.util").util.find_spec("sglang").origin).parent
HERE = "tests/test_host_sampler.py"


def stage_span(name: str):
    return nullcontext()


def draft_work() -> int:
    """A third of verify_work's work, releasing the GIL now and then as torch ops do."""
    x = 0
    for i in range(6000):
        x += i * i
        if i % 1000 == 0:
            time.sleep(0)
    return x


def verify_work() -> int:
    x = 0
    for i in range(18000):
        x += i * i
        if i % 1000 == 0:
            time.sleep(0)
    return x


def fake_step() -> None:
    with stage_span("draft"):
        draft_work()
    with stage_span("verify"):
        verify_work()


def fake_loop(steps: int) -> None:
    for _ in range(steps):
        fake_step()


def sampled(steps: int = 80) -> dict:
    """A sampler over `steps` of the workload, with fake_step staged and fake_loop the loop."""
    sampler = HostSampler(threading.get_ident(), staged=frozenset({(HERE, "fake_step")}),
                          loops=frozenset({(HERE, "fake_loop")})).start()
    fake_loop(steps)
    return sampler.stop()


def test_the_hot_functions_and_stages_dominate_in_proportion():
    rec = sampled()
    n = rec["samples"]
    assert n > 0 and rec["window_ms"] > 0
    own = {f.split(":")[-1]: v["samples"] for f, v in rec["self"].items()}
    assert own["verify_work"] > 1.5 * own["draft_work"] > 0  # 3x the work (a busy CPU blurs)
    assert own["verify_work"] + own["draft_work"] > 0.7 * n
    stages = rec["stages"]
    assert stages["fake_step > verify"] > 1.5 * stages["fake_step > draft"] > 0
    cumulative = {f.split(":")[-1]: c for f, c in rec["cumulative"].items()}
    assert cumulative["fake_step"] > 0.8 * n
    # the loop and what holds it are on every stack: left out (but for the samples outside
    # the loop, of the sampler's own start on a busy machine)
    assert "fake_loop" not in cumulative
    outside = rec["stages"].get("outside the event loop", 0)
    assert all(c <= outside for f, c in rec["cumulative"].items() if "pytest" in f)
    assert f"{HERE}:verify_work" in rec["self"]  # file:function
    # loosely bounded overhead: the sampling thread held the GIL for a small part of the window
    assert rec["sampler_ms"] < 0.25 * rec["window_ms"]


def _code_of(path: Path, qualname: str) -> CodeType:
    """A function's code object compiled from its file, without importing the module."""
    todo = [compile(path.read_text(), str(path), "exec")]
    while todo:
        code = todo.pop()
        if code.co_qualname == qualname:
            return code
        todo += [c for c in code.co_consts if isinstance(c, CodeType)]
    raise LookupError(qualname)


def test_stages_are_read_from_ddtree_spans_and_dflash_sections():
    """DDTREE: the spec_stage_span blocks of DecodeStep.run (a line after the last block has
    no stage); DFLASH: the numbered sections of SGLang's forward_batch_generation.  The loops
    and staged functions the sampler names exist in the installed SGLang and this package."""
    path = ROOT / "src/ddtree_sglang/sglang_plugin/decode_step.py"
    run = stage_lines(_code_of(path, "DecodeStep.run"))
    assert set(run.values()) == {"ddtree_draft_tree", "ddtree_verify", "ddtree_sample_accept",
                                 "ddtree_commit"}
    end = next(n for n, text in enumerate(path.read_text().splitlines(), 1)
               if "self.end_step(" in text)
    assert end not in run
    dflash = stage_lines(_code_of(SGLANG / "srt/speculative/dflash_worker_v2.py",
                                  "DFlashWorkerV2.forward_batch_generation"))
    assert sorted(set(dflash.values())) == [
        "1) Draft a fixed block with the draft model", "2) Target verify",
        "3) Materialize committed verify-input tokens into draft KV cache"]
    for suffix, fn in host_sampler.LOOPS:
        assert f"def {fn}(" in (SGLANG.parent / suffix).read_text()


@pytest.fixture
def hook_registry(monkeypatch):
    """A stand-in for SGLang's HookRegistry module (the real one imports all of sglang.srt and
    torch): what register() registers, by target."""
    registry = SimpleNamespace(hooks={})
    registry.register = lambda target, hook, kind: registry.hooks.setdefault(target, (hook, kind))
    module = ModuleType("sglang.srt.plugins.hook_registry")
    module.HookRegistry, module.HookType = registry, SimpleNamespace(AROUND="around")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return registry


def _register_as_scheduler() -> None:
    """register() called as SGLang's run_scheduler_process calls the plugins."""
    scope = {"__name__": "sglang.srt.managers.scheduler", "register": host_sampler.register}
    exec("def run_scheduler_process():\n    register()\nrun_scheduler_process()", scope)


def test_the_entry_point_does_nothing_without_the_env_var_or_outside_a_scheduler(
        monkeypatch, hook_registry):
    monkeypatch.delenv(host_sampler.ENV, raising=False)
    _register_as_scheduler()
    assert hook_registry.hooks == {}
    monkeypatch.setenv(host_sampler.ENV, "1")
    host_sampler.register()  # the launcher, the tokenizer manager: not a scheduler
    assert hook_registry.hooks == {}
    _register_as_scheduler()
    assert hook_registry.hooks == {
        f"{host_sampler.PROFILER}._start_profile": (host_sampler._start_hook, "around"),
        f"{host_sampler.PROFILER}._stop_profile": (host_sampler._stop_hook, "around")}
    # the hooked methods, in the installed SGLang (read, not imported: it pulls in torch)
    module, cls = host_sampler.PROFILER.rsplit(".", 1)
    source = (SGLANG.parent / (module.replace(".", "/") + ".py")).read_text()
    assert f"class {cls}" in source
    assert "def _start_profile(" in source and "def _stop_profile(" in source


def test_the_entry_point_is_declared_for_installs_and_checkouts():
    """benchmarks/pyproject.toml declares it (the product's pyproject does not: pip install
    ddtree-sglang installs no benchmark code); scripts/checkout_env.sh writes the same."""
    bench = tomllib.loads((ROOT / "benchmarks/pyproject.toml").read_text())
    line = bench["project"]["entry-points"]["sglang.srt.plugins"]
    assert line == {"ddtree_bench_host_samples": "ddtree_bench.host_sampler:register"}
    product = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "ddtree_bench" not in json.dumps(product)
    assert ("ddtree_bench_host_samples = ddtree_bench.host_sampler:register"
            in (ROOT / "scripts/checkout_env.sh").read_text())


def _manager(out: Path, activities: list[str]) -> SimpleNamespace:
    """What the hooks read of SGLang's SchedulerProfilerManager."""
    count = [0]
    return SimpleNamespace(profiler_activities=activities, torch_profiler_output_dir=out,
                           ps=SimpleNamespace(tp_rank=0), get_forward_ct=lambda: count[0],
                           count=count)


def test_a_window_of_steps_from_the_profilers_start_to_its_stop(tmp_path):
    """A start naming HOST_SAMPLES opens the window, SGLang's stop from run_batch of the first
    step after it closes it: the file counts the steps between; the harness's table adds its
    stages up to the step.  A start without the activity samples nothing."""
    calls = []

    def original(manager, *args):
        calls.append(args)

    plain = _manager(tmp_path / "plain", ["GPU"])
    host_sampler._start_hook(original, plain)
    host_sampler._stop_hook(original, plain)
    assert not (tmp_path / "plain").exists() and len(calls) == 2

    m = _manager(tmp_path, [host_sampler.ACTIVITY])
    host_sampler._start_hook(original, m)
    for _ in range(12):  # run_batch: the forward count first, then the step
        m.count[0] += 1
        fake_step()
    m.count[0] += 1  # the first step after the window: SGLang's stop comes first in it
    host_sampler._stop_hook(original, m)
    (path,) = tmp_path.glob(host_sampler.FILE_GLOB)
    assert path.name == "host-samples-TP-0.json" and host_sampler._window is None
    m.count[0] += 1
    host_sampler._stop_hook(original, m)  # SGLang stops again on every later step: no-op
    rec = profile.read_samples(path)
    assert rec["steps"] == 12 and rec["samples"] > 0
    table = profile.host_table(rec)
    assert table["steps"] == 12
    assert sum(table["stages"].values()) == pytest.approx(table["step_ms"], rel=0.01)
    assert f"{HERE}:verify_work" in {r["function"] for r in table["self"]}
    md = "\n".join(profile.host_markdown({"dflash@1": {"host": table},
                                          "ddtree@1": {"host": table}}))
    assert "## host: where the scheduler's time goes per decode step" in md
    assert "| stage | dflash@1 | ddtree@1 |" in md
    assert "### batch 1: top functions by self time, ms per step" in md
