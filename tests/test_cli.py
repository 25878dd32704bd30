"""Every command-line tool ends bad input in one line naming the value or file, exit code 2,
no traceback, before any long work starts."""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from ddtree_sglang import demo

ROOT = Path(__file__).resolve().parents[1]
NEEDS_TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="the script compiles Triton kernels")
TESTBED = ROOT / "testbed"


def one_error_line(capsys, call, prog: str) -> str:
    try:
        rc = call()
    except SystemExit as exc:  # argparse's own refusals
        rc = exc.code
    assert rc == 2
    err = [l for l in capsys.readouterr().err.strip().splitlines() if l.strip()]
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    assert "Traceback" not in err[0]
    return err[0]


def broken_testbed(tmp_path, prompts_text: str | None) -> Path:
    """A copy of the testbed (links to its models) with the given prompts.jsonl content."""
    tb = tmp_path / "tb"
    tb.mkdir()
    (tb / "target").symlink_to(TESTBED / "target")
    (tb / "drafter").symlink_to(TESTBED / "drafter")
    if prompts_text is not None:
        (tb / "prompts.jsonl").write_text(prompts_text)
    return tb


@pytest.mark.parametrize("argv, needle", [
    (["--threads", "-3"], "argument --threads: expected an integer >= 0; got '-3'"),
    (["--budget", "0"], "argument --budget: expected a positive integer"),
    (["--temperature", "inf"], "argument --temperature: expected a finite number; got 'inf'"),
    (["--temperature", "nan"], "expected a finite number"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--prompts", "x"], "argument --prompts: expected a positive integer"),
    (["--testbed", "/nonexistent/tb"], "/nonexistent/tb: no such directory"),
])
def test_demo_refuses_bad_arguments(capsys, argv, needle):
    line = one_error_line(capsys, lambda: demo.main(argv), "ddtree-demo")
    assert needle in line, line


@pytest.mark.parametrize("prompts_text, needle", [
    (None, "prompts.jsonl is missing"),
    ("", "no prompts in the file"),
    ("\n\n", "no prompts in the file"),
    ('{"prompt": "ok"}\nnot json\n', "line 2: not valid JSON"),
    ('{"text": "wrong key"}\n', 'line 1: expected {"prompt": text}'),
])
def test_demo_names_a_bad_prompts_file(tmp_path, capsys, prompts_text, needle):
    tb = broken_testbed(tmp_path, prompts_text)
    line = one_error_line(capsys, lambda: demo.main(["--testbed", str(tb)]), "ddtree-demo")
    assert needle in line, line


def test_demo_checks_limits_before_generating(capsys):
    line = one_error_line(capsys, lambda: demo.main(["--budget", "1000000"]), "ddtree-demo")
    assert "--budget 1000000: one tree verify needs about" in line and "accepted on this machine: 1.." in line
    line = one_error_line(capsys, lambda: demo.main(["--max-new-tokens", "5000"]), "ddtree-demo")
    assert "--max-new-tokens 5000" in line and "2048 positions; accepted: 1..1" in line
    line = one_error_line(capsys, lambda: demo.main(["--prompts", "999"]), "ddtree-demo")
    assert "holds 32; accepted: 1..32" in line
    line = one_error_line(capsys, lambda: demo.main(["--auto-budgets", "4,1000000"]),
                          "ddtree-demo")
    assert "--auto-budgets 1000000: one tree verify needs about" in line
    line = one_error_line(capsys, lambda: demo.main(["--auto-budgets", "4,x"]), "ddtree-demo")
    assert "argument --auto-budgets" in line and "comma-separated" in line


def test_reference_loop_refuses_output_past_the_positions():
    from ddtree_sglang.reference.testbed import load_testbed

    spec = load_testbed(TESTBED).speculator
    room = spec.max_new_tokens_for(100)
    assert room == 2048 - 100 - spec.cfg.block_size
    with pytest.raises(ValueError, match=f"leaves room for {room} new tokens"):
        spec.generate([5] * 100, room + 1, mode="ar")


@pytest.mark.parametrize("script, argv, needle", [
    ("scripts/eval_testbed.py", ["--prompts", "0"], "argument --prompts: expected a positive integer"),
    ("scripts/eval_testbed.py", ["--testbed", "/nonexistent"], "/nonexistent: no such directory"),
    ("scripts/eval_testbed.py", ["--device", "cuda:0"], "no CUDA GPU is visible"),
    ("scripts/drafter_accuracy.py", ["--seqs", "-1"], "argument --seqs: expected a positive integer"),
    ("scripts/train_testbed.py", ["--target-seconds", "-5"],
     "argument --target-seconds: expected a number > 0"),
    ("scripts/train_testbed.py", ["--soft-weight", "nan"], "expected a finite number"),
    ("benchmarks/tree_build.py", ["--depth", "0"], "argument --depth: expected a positive integer"),
    ("benchmarks/tree_build.py", [], "needs a CUDA GPU"),
    pytest.param("benchmarks/tree_kernel_compile.py", ["--budgets", "999"],
                 "999 is outside the kernel's 1..256", marks=NEEDS_TRITON),
    pytest.param("benchmarks/tree_kernel_compile.py", ["--kernel-file", "/nonexistent"],
                 "/nonexistent: no such file", marks=NEEDS_TRITON),
    pytest.param("benchmarks/tree_attention_registers.py", ["--archs", "80"],
                 "--archs: accepted 90 (H200) and 120", marks=NEEDS_TRITON),
])
def test_scripts_refuse_bad_input_in_one_line(script, argv, needle, monkeypatch, capsys):
    """Run as `python <script> ...` would, in this process (a subprocess each cost seconds of
    imports): exit code 2 and one line on stderr naming the problem."""
    import runpy

    path = ROOT / script
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(path.parent))
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    saved = dict(os.environ)  # a script may set variables of its own (TRITON_INTERPRET)
    try:
        with pytest.raises(SystemExit) as exit_:
            runpy.run_path(str(path), run_name="__main__")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert exit_.value.code == 2, err
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0], err


def test_demo_runs_with_a_per_step_budget(capsys, monkeypatch):
    """The demo's auto row: costs timed here, a budget chosen per step, output still greedy."""
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    assert demo.main(["--prompts", "1", "--max-new-tokens", "12", "--budget", "8",
                      "--auto-budgets", "2,8", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "DDTree auto 2/8 (mean B" in out
    assert "DDTree output identical to autoregressive greedy: True" in out
    assert "DDTree auto output identical to autoregressive greedy: True" in out


def test_the_demo_s_words_are_the_readme_s(capsys):
    """The demo's help and the committed demo output speak of accept length (the README's
    term), never of tau or 'acceptance length accept length'."""
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    text = capsys.readouterr().out + (demo.__doc__ or "")
    assert "accept length" in text and "acceptance length accept length" not in text
    for f in (ROOT / "benchmarks" / "results").glob("demo_cpu_*.txt"):
        assert "tau" not in f.read_text(), f.name


def installed_copy(tmp_path, direct_url: str | None) -> Path:
    """The package as `pip install` lays it out: a copy in a site-packages folder with no
    testbed/ beside it, and a dist-info whose direct_url.json (PEP 610) is `direct_url`
    (None: installed from an index, which records none)."""
    import shutil

    site = tmp_path / "lib" / "python3" / "site-packages"
    shutil.copytree(ROOT / "src" / "ddtree_sglang", site / "ddtree_sglang",
                    ignore=shutil.ignore_patterns("__pycache__"))
    info = site / "ddtree_sglang-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ddtree-sglang\nVersion: 0.1.0\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(direct_url)
    return site


def run_installed(site: Path, command: list[str]):
    """Run a command with the installed copy first on sys.path, outside the clone."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(command, env=env, cwd=site, capture_output=True, text=True, timeout=300)


def test_demo_installed_from_a_wheel_says_where_the_testbed_is(tmp_path):
    """`ddtree-demo` after an install from a wheel (no testbed in it, no clone recorded): one
    line naming what it needs and where it is, exit code 2, no traceback."""
    site = installed_copy(tmp_path, None)
    done = run_installed(site, [str(Path(sys.executable).parent / "ddtree-demo")])
    assert done.returncode == 2, done.stderr
    err = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith("ddtree-demo: error: no testbed found (a folder with target/, "
                             "drafter/ and prompts.jsonl); the shipped testbed pair (8 MB) is the "
                             "testbed/ folder of a ddtree-sglang clone, not in the wheel: pass "
                             "--testbed CLONE/testbed"), err


def test_demo_installed_from_a_clone_uses_the_clone_s_testbed(tmp_path):
    """`pip install .` in a clone records the clone's folder: the installed copy finds its
    testbed there."""
    site = installed_copy(tmp_path, json.dumps({"url": ROOT.as_uri(), "dir_info": {}}))
    done = run_installed(site, [sys.executable, "-c", "from ddtree_sglang.reference import "
                                "testbed as t; print(t.__file__, t.find_testbed())"])
    assert done.returncode == 0, done.stderr
    module, found = done.stdout.split()
    assert module.startswith(str(site)) and found == str(TESTBED)
