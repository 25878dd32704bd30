"""sglang_plugin/settings.py: every DDTREE knob in one frozen object, each bad value refused
with the accepted values named, at startup (through validate) and for benchmark arms."""
import re
from pathlib import Path

import pytest
from conftest import server_args

from ddtree_sglang.sglang_plugin.settings import (BUDGET_TRACE_ENV, KNOBS, MIN_GAIN_ENV,
                                                  DDTreeConfigError, DDTreeSettings, check_env,
                                                  parse_budgets)

ROOT = Path(__file__).resolve().parents[1]
DRAFTER = ROOT / "testbed" / "drafter"


def settings(**env) -> DDTreeSettings:
    return DDTreeSettings.from_values(32, 16, environ=env)


def test_defaults():
    s = settings()
    assert (s.budget, s.block_size, s.depth, s.verify_width) == (32, 16, 15, 33)
    assert s.budgets == (7, 15, 32) and s.min_gain == 0.03 and s.explore_every == 32
    assert (s.tree_kernel, s.verify_attention, s.verify_attention_named) == ("auto", "kernel",
                                                                            False)
    assert s.cuda_graph_tree and not s.host_timing and s.budget_trace and s.grammar == "tree"
    with pytest.raises(AttributeError):
        s.budget = 7  # frozen
    assert set(KNOBS) == {"SGLANG_DDTREE_BUDGETS", "SGLANG_DDTREE_BUDGET_MIN_GAIN",
                          "SGLANG_DDTREE_EXPLORE_EVERY", "SGLANG_DDTREE_TREE_KERNEL",
                          "SGLANG_DDTREE_VERIFY_ATTENTION", "SGLANG_DDTREE_CUDA_GRAPH_TREE",
                          "SGLANG_DDTREE_HOST_TIMING", "SGLANG_DDTREE_BUDGET_TRACE",
                          "SGLANG_DDTREE_GRAMMAR", "SGLANG_DDTREE_GRAMMAR_BUDGET",
                          "SGLANG_DDTREE_GRAMMAR_TREE", "SGLANG_DDTREE_GRAMMAR_FORCE",
                          "SGLANG_DDTREE_UNCHECKED"}
    assert s.grammar_budget == "shared" and s.grammar_tree == "all" and s.grammar_force == "off"
    with pytest.raises(DDTreeConfigError, match="accepted: shared, own"):
        settings(SGLANG_DDTREE_GRAMMAR_BUDGET="lane")
    with pytest.raises(DDTreeConfigError, match="accepted: off, spine"):
        settings(SGLANG_DDTREE_GRAMMAR_FORCE="on")
    assert settings(SGLANG_DDTREE_GRAMMAR_FORCE="spine").grammar_force == "spine"


def test_every_knob_is_in_the_readme_s_table_with_its_reason():
    rows = [line for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("| `SGLANG_DDTREE_")]
    named = {line.split("`")[1]: line for line in rows}
    assert set(named) == set(KNOBS)
    for name, line in named.items():
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 4 and cells[3], name  # setting, default, accepted, why


def test_values_from_the_environment():
    s = settings(SGLANG_DDTREE_BUDGETS="off", SGLANG_DDTREE_BUDGET_MIN_GAIN=" 0 ",
                 SGLANG_DDTREE_EXPLORE_EVERY="0", SGLANG_DDTREE_TREE_KERNEL="torch",
                 SGLANG_DDTREE_VERIFY_ATTENTION="split", SGLANG_DDTREE_CUDA_GRAPH_TREE="0",
                 SGLANG_DDTREE_HOST_TIMING="1", SGLANG_DDTREE_BUDGET_TRACE="0",
                 SGLANG_DDTREE_GRAMMAR="path")
    assert s.grammar == "path"
    assert s.budgets == (32,) and s.min_gain == 0.0 and s.explore_every == 0
    assert s.tree_kernel == "torch" and s.verify_attention == "split" and s.verify_attention_named
    assert not s.cuda_graph_tree and s.host_timing and not s.budget_trace


@pytest.mark.parametrize("name, value, needle", [
    ("SGLANG_DDTREE_TREE_KERNEL", "cuda", "accepted: auto, torch, triton"),
    ("SGLANG_DDTREE_CUDA_GRAPH_TREE", "yes", "accepted: 1, 0"),
    ("SGLANG_DDTREE_VERIFY_ATTENTION", "fast", "VERIFY_ATTENTION='fast'.*accepted: kernel, "
                                               "single, split"),
    ("SGLANG_DDTREE_BUDGETS", "7,40", r"BUDGETS='7,40' names a budget outside 1..32"),
    ("SGLANG_DDTREE_EXPLORE_EVERY", "1", r"EXPLORE_EVERY='1'.*integer >= 2.*or 0"),
    ("SGLANG_DDTREE_EXPLORE_EVERY", "often", "accepted: an integer >= 2"),
    ("SGLANG_DDTREE_BUDGET_MIN_GAIN", "2", r"MIN_GAIN='2'.*accepted: a number in \[0, 0.5\]"),
    ("SGLANG_DDTREE_BUDGET_MIN_GAIN", "3%", r"accepted: a number in \[0, 0.5\]"),
    ("SGLANG_DDTREE_HOST_TIMING", "on", "accepted: 0, 1"),
    ("SGLANG_DDTREE_BUDGET_TRACE", "yes", "accepted: 1, 0"),
    ("SGLANG_DDTREE_GRAMMAR", "fast", "accepted: tree, path, auto, python"),
])
def test_each_bad_value_names_the_accepted_ones(name, value, needle):
    with pytest.raises(DDTreeConfigError, match=needle):
        settings(**{name: value})
    if name != "SGLANG_DDTREE_BUDGETS":  # a benchmark arm's env: the same check
        with pytest.raises(DDTreeConfigError, match=needle):
            check_env(name, value)


def test_every_bad_knob_is_reported_at_once():
    with pytest.raises(DDTreeConfigError) as err:
        settings(SGLANG_DDTREE_TREE_KERNEL="cuda", SGLANG_DDTREE_HOST_TIMING="on")
    assert "TREE_KERNEL" in str(err.value) and "HOST_TIMING" in str(err.value)


def test_budget_candidates():
    assert parse_budgets("auto", 32) == (7, 15, 32)
    assert parse_budgets("off", 32) == (32,)
    assert parse_budgets(" 9, 4,9 ", 32) == (4, 9, 32)  # sorted, deduplicated, B added
    assert parse_budgets("4,32", 32) == (4, 32)
    for bad, needle in (("fast", "accepted: auto .default., off"), ("0,4", "outside 1..32"),
                        ("", "accepted: auto"), ("4;8", "accepted: auto")):
        with pytest.raises(DDTreeConfigError, match=needle):
            parse_budgets(bad, 32)
    check_env("SGLANG_DDTREE_BUDGETS", "16,64")  # benchmark arms: syntax only, B not known


def test_benchmark_env_checks_names_and_values():
    check_env(MIN_GAIN_ENV, "0.05")
    check_env(BUDGET_TRACE_ENV, "0")
    check_env("SGLANG_DDTREE_EXPLORE_EVERY", "8")
    with pytest.raises(DDTreeConfigError, match="unknown setting 'SGLANG_DDTREE_BUDGET_MIN_GAINS'"
                                                "; did you mean SGLANG_DDTREE_BUDGET_MIN_GAIN\\?"):
        check_env("SGLANG_DDTREE_BUDGET_MIN_GAINS", "0.05")


def test_a_misspelt_knob_stops_startup_naming_the_nearest_known_one():
    """SGLANG_DDTREE_BUDGET=off (for BUDGETS) would otherwise be ignored: the settings refuse
    every SGLANG_DDTREE_* name that is no knob, with the other problems, and leave other
    variables alone."""
    with pytest.raises(DDTreeConfigError) as err:
        DDTreeSettings.from_values(32, 16, {"SGLANG_DDTREE_BUDGET": "off",
                                            "SGLANG_DDTREE_GRAMMAR": "fast",
                                            "SGLANG_DDTREE_XYZZY": "1", "SGLANG_OTHER": "1"})
    msg = str(err.value)
    assert "unknown setting 'SGLANG_DDTREE_BUDGET'; did you mean SGLANG_DDTREE_BUDGETS?" in msg
    assert "unknown setting 'SGLANG_DDTREE_XYZZY'; accepted: SGLANG_DDTREE_BUDGETS" in msg
    assert "SGLANG_DDTREE_GRAMMAR='fast' is not accepted" in msg and "SGLANG_OTHER" not in msg
    DDTreeSettings.from_values(32, 16, {"SGLANG_OTHER": "1", "SGLANG_DDTREE_BUDGETS": "off"})


def test_validation_reports_bad_knobs_with_the_other_problems(monkeypatch):
    from ddtree_sglang.sglang_plugin.server_args import settings_from_args, validate

    base = dict(device="cuda", speculative_draft_model_path=str(DRAFTER),
                speculative_num_draft_tokens=33, attention_backend="triton", page_size=1)
    monkeypatch.setenv("SGLANG_DDTREE_TREE_KERNEL", "cuda")
    with pytest.raises(DDTreeConfigError, match=re.escape("accepted: auto, torch, triton")):
        validate(server_args(**base, tp_size=2))
    monkeypatch.setenv("SGLANG_DDTREE_TREE_KERNEL", "triton")
    validate(server_args(**base))
    s = settings_from_args(server_args(**base))
    assert (s.budget, s.block_size, s.tree_kernel) == (32, 16, "triton")


def test_set_ups_awaiting_their_gpu_check_start_only_when_named(monkeypatch):
    """tp > 1 and page sizes up to 64 are implemented and refused until a GPU run checks them;
    SGLANG_DDTREE_UNCHECKED lets that run start them, and nothing else."""
    from ddtree_sglang.sglang_plugin.server_args import validate

    base = dict(device="cuda", speculative_draft_model_path=str(DRAFTER),
                speculative_num_draft_tokens=33, attention_backend="triton")
    for extra, needle in ((dict(tp_size=2), "awaits its GPU check"),
                          (dict(page_size=16), "await their GPU check")):
        with pytest.raises(DDTreeConfigError, match=needle):
            validate(server_args(**base, **extra))
    monkeypatch.setenv("SGLANG_DDTREE_UNCHECKED", "tp,page_size")
    validate(server_args(**base, tp_size=2, page_size=16))
    with pytest.raises(DDTreeConfigError, match="--page-size 1 for now; got 128"):
        validate(server_args(**base, page_size=128))  # past the implemented 64
    with pytest.raises(DDTreeConfigError, match="--pp-size 1 only"):
        validate(server_args(**base, pp_size=2))
    monkeypatch.setenv("SGLANG_DDTREE_UNCHECKED", "dp")
    with pytest.raises(DDTreeConfigError, match="accepted: off .default. or a comma list of tp, "
                                                "page_size"):
        validate(server_args(**base))
