"""`ddtree-check`: SGLang finds the plugin, and the SGLANG_DDTREE_* settings of the environment
are ones a server accepts; any problem is a line of its own and exit status 1."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="ddtree-check loads SGLang's plugins")

from ddtree_sglang.sglang_plugin.check import main  # noqa: E402
from ddtree_sglang.sglang_plugin.settings import PREFIX  # noqa: E402


@pytest.fixture
def clean_env(monkeypatch):
    """No SGLANG_DDTREE_* setting and no SGLANG_PLUGINS list, whatever the shell had."""
    import os

    for name in [n for n in os.environ if n.startswith(PREFIX)] + ["SGLANG_PLUGINS"]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_registered_plugin_and_good_settings_exit_0_with_one_line(capsys, clean_env):
    """README: `ddtree-check` is how a user sees that SGLang finds DDTREE (SGLang's --help
    lists only its built-in algorithms)."""
    clean_env.setenv("SGLANG_DDTREE_BUDGETS", "8,16")
    clean_env.setenv("SGLANG_DDTREE_DEBUG", "host_timing")
    assert main() == 0
    out, err = capsys.readouterr()
    assert out.startswith("DDTREE is registered") and len(out.splitlines()) == 1
    assert err == ""


def test_every_bad_setting_is_a_line_of_its_own_and_exit_1(capsys, clean_env):
    clean_env.setenv("SGLANG_DDTREE_BUDGET", "8")            # misspelt
    clean_env.setenv("SGLANG_DDTREE_GRAMMAR", "fast")        # a bad value
    clean_env.setenv("SGLANG_DDTREE_HOST_TIMING", "1")       # retired
    assert main() == 1
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert lines[0].startswith("DDTREE is registered")
    problems = [line for line in lines if line.startswith("  - ")]
    assert len(problems) == 3, lines
    assert any("'SGLANG_DDTREE_BUDGET'; did you mean SGLANG_DDTREE_BUDGETS?" in p
               for p in problems)
    assert any("SGLANG_DDTREE_GRAMMAR='fast' is not accepted; accepted: tree, path, auto" in p
               for p in problems)
    assert any("retired: SGLANG_DDTREE_DEBUG=host_timing" in p for p in problems)


def test_a_budget_list_outside_0_to_1023_is_refused(capsys, clean_env):
    clean_env.setenv("SGLANG_DDTREE_BUDGETS", "8,2000")
    assert main() == 1
    assert "names a budget outside 0..1023" in capsys.readouterr().err


def test_sglang_plugins_leaving_the_plugin_out_is_named(capsys, clean_env):
    """With SGLANG_PLUGINS naming other plugins SGLang skips this one: the check says so
    instead of blaming the install; a list that names ddtree passes."""
    clean_env.setenv("SGLANG_PLUGINS", "other_plugin")
    assert main() == 1
    err = capsys.readouterr().err
    assert "SGLANG_PLUGINS='other_plugin' leaves out this plugin" in err
    assert "installed" not in err
    clean_env.setenv("SGLANG_PLUGINS", "other_plugin, ddtree")
    assert main() == 0


def test_an_unregistered_plugin_and_a_bad_setting_are_both_reported(capsys, clean_env):
    clean_env.setenv("SGLANG_PLUGINS", "other_plugin")
    clean_env.setenv("SGLANG_DDTREE_GRAMMAR_FORCE", "on")
    assert main() == 1
    err = capsys.readouterr().err
    assert "leaves out this plugin" in err
    assert "SGLANG_DDTREE_GRAMMAR_FORCE='on' is not accepted; accepted: off, spine" in err


def test_an_sglang_that_does_not_know_ddtree_names_what_to_install(capsys, clean_env):
    from ddtree_sglang.sglang_plugin import sglang_api as sg

    def unknown(name):
        raise ValueError(f"Unknown speculative algorithm name: {name}")

    clean_env.setattr(sg.SpeculativeAlgorithm, "from_string", unknown)
    assert main() == 1
    err = capsys.readouterr().err
    assert "does not know DDTREE after loading its plugins" in err
    assert f"install ddtree-sglang into the environment sglang runs from (its python: " \
           f"{sys.executable})" in err


def test_the_off_budget_setting_says_what_off_does(capsys, clean_env):
    """`off` keeps the server's own B (its --speculative-num-draft-tokens - 1), which the check
    cannot know: the refusal names every accepted value and says what each does, never a
    made-up B."""
    clean_env.setenv("SGLANG_DDTREE_BUDGETS", "abc")
    assert main() == 1
    err = capsys.readouterr().err
    assert "SGLANG_DDTREE_BUDGETS='abc' is not accepted; accepted: auto (default), off, or a " \
           "comma list of budgets in 0..1023" in err
    assert "off always verifies B" in err and "B is the server's tree budget, " \
           "--speculative-num-draft-tokens - 1" in err
    assert "B = 1023" not in err


def run_console_script() -> subprocess.CompletedProcess:
    """`ddtree-check` as a user runs it, in this process's environment."""
    return subprocess.run([str(Path(sys.executable).parent / "ddtree-check")],
                          env=dict(os.environ), capture_output=True, text=True, timeout=300)


def test_the_console_script_answers_first(clean_env):
    """Its answer is the first line, without the warnings and log lines SGLang's import emits
    on a machine without a GPU (AWQ, GGUF, Triton, CUDA_HOME)."""
    done = run_console_script()
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout.startswith("DDTREE is registered") and len(done.stdout.splitlines()) == 1
    clean_env.setenv("SGLANG_DDTREE_GRAMMAR", "fast")
    done = run_console_script()
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("DDTREE is registered"), done.stderr
