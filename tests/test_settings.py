"""sglang_plugin/settings.py: the four SGLANG_DDTREE_* settings in one frozen object, each bad
value refused with the accepted values named, at startup (through validate), before a GPU is
needed (ddtree-check) and for benchmark arms."""
import re
from pathlib import Path

import pytest
from conftest import server_args

from ddtree_sglang.sglang_plugin.settings import (DEBUG_FLAGS, RETIRED, SETTINGS,
                                                  DDTreeConfigError, DDTreeSettings, check_env,
                                                  environment_problems, parse_budgets)

ROOT = Path(__file__).resolve().parents[1]
DRAFTER = ROOT / "testbed" / "drafter"


def settings(**env) -> DDTreeSettings:
    return DDTreeSettings.from_values(32, 16, environ=env)


def test_defaults():
    s = settings()
    assert (s.budget, s.block_size, s.depth, s.verify_width) == (32, 16, 15, 33)
    assert s.budgets == (7, 15, 32) and s.min_gain == 0.03 and s.explore_every == 32
    assert (s.tree_kernel, s.verify_attention, s.host_timing) == ("auto", "kernel", False)
    assert (s.grammar_method, s.grammar_force, s.debug) == ("tree", "off", frozenset())
    with pytest.raises(AttributeError):
        s.budget = 7  # frozen
    assert set(SETTINGS) == {"SGLANG_DDTREE_BUDGETS", "SGLANG_DDTREE_GRAMMAR",
                             "SGLANG_DDTREE_GRAMMAR_FORCE", "SGLANG_DDTREE_DEBUG",
                             "SGLANG_DDTREE_SIMULATE_ACC"}
    assert s.simulate_acc == ()


def test_every_setting_is_in_the_readme_s_table_with_its_reason():
    rows = [line for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("| `SGLANG_DDTREE_")]
    named = {line.split("`")[1]: line for line in rows}
    assert set(named) == set(SETTINGS)
    for name, line in named.items():
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 4 and cells[3], name  # setting, default, accepted, why


def test_values_from_the_environment():
    s = settings(SGLANG_DDTREE_BUDGETS="off", SGLANG_DDTREE_GRAMMAR="path",
                 SGLANG_DDTREE_GRAMMAR_FORCE="spine",
                 SGLANG_DDTREE_DEBUG=" torch_tree,host_timing , sglang_attention")
    assert (s.budgets, s.grammar_method, s.grammar_force) == ((32,), "path", "spine")
    assert (s.tree_kernel, s.verify_attention, s.host_timing) == ("torch", "single", True)
    assert settings(SGLANG_DDTREE_DEBUG="").debug == frozenset()


@pytest.mark.parametrize("name, value, needle", [
    ("SGLANG_DDTREE_BUDGETS", "7,40", r"BUDGETS='7,40' names a budget outside 0..32"),
    ("SGLANG_DDTREE_GRAMMAR", "fast", r"GRAMMAR='fast' is not accepted; accepted: tree, path, "
                                      r"auto \(default tree\)"),
    ("SGLANG_DDTREE_GRAMMAR", "python", "accepted: tree, path, auto"),
    ("SGLANG_DDTREE_GRAMMAR_FORCE", "on", "accepted: off, spine"),
    ("SGLANG_DDTREE_DEBUG", "host_timing,fast", r"names unknown flag\(s\) fast; accepted: a "
                                                r"comma list of host_timing, torch_tree"),
])
def test_each_bad_value_names_the_accepted_ones(name, value, needle):
    with pytest.raises(DDTreeConfigError, match=needle):
        settings(**{name: value})
    if name != "SGLANG_DDTREE_BUDGETS":  # a benchmark arm's env: the same check
        with pytest.raises(DDTreeConfigError, match=needle):
            check_env(name, value)


def test_every_problem_is_reported_at_once():
    problems = environment_problems({"SGLANG_DDTREE_GRAMMAR": "fast",
                                     "SGLANG_DDTREE_DEBUG": "loud",
                                     "SGLANG_DDTREE_BUDGET": "off"})
    assert len(problems) == 3
    with pytest.raises(DDTreeConfigError) as err:
        settings(SGLANG_DDTREE_GRAMMAR="fast", SGLANG_DDTREE_DEBUG="loud")
    assert "GRAMMAR='fast'" in str(err.value) and "DEBUG='loud'" in str(err.value)
    assert environment_problems({"SGLANG_OTHER": "1"}) == []


def test_budget_candidates():
    assert parse_budgets("auto", 32) == (7, 15, 32)
    assert parse_budgets("off", 32) == (32,)
    assert parse_budgets(" 9, 4,9 ", 32) == (4, 9, 32)  # sorted, deduplicated, B added
    assert parse_budgets("4,32", 32) == (4, 32)
    assert parse_budgets("0,7", 32) == (0, 7, 32)  # 0: no speculation
    for bad, needle in (("fast", "accepted: auto .default., off"), ("-1,4", "outside 0..32"),
                        ("", "accepted: auto"), ("4;8", "accepted: auto")):
        with pytest.raises(DDTreeConfigError, match=needle):
            parse_budgets(bad, 32)
    check_env("SGLANG_DDTREE_BUDGETS", "16,64")  # benchmark arms: syntax only, B not known


def test_a_bad_budget_list_says_what_each_accepted_value_does():
    """`off` keeps the server's B; the refusal says so against the B it was judged with."""
    with pytest.raises(DDTreeConfigError) as err:
        parse_budgets("abc", 32)
    msg = str(err.value)
    assert "accepted: auto (default), off, or a comma list of budgets in 0..32 (0: no " \
           "speculation); auto chooses per decode batch among budgets up to B, off always " \
           "verifies B, a list chooses among its budgets and B, where B is the server's tree " \
           "budget, --speculative-num-draft-tokens - 1" in msg


def test_a_misspelt_setting_stops_startup_naming_the_nearest_known_one():
    """SGLANG_DDTREE_BUDGET=off (for BUDGETS) would otherwise be ignored: the settings refuse
    every SGLANG_DDTREE_* name that is none, with the other problems, and leave other
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


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_a_retired_setting_says_what_replaced_it(name):
    with pytest.raises(DDTreeConfigError, match=f"unknown setting '{name}'; it was retired: "):
        check_env(name, "1")


def test_validation_reports_bad_settings_with_the_other_problems(monkeypatch):
    from ddtree_sglang.sglang_plugin.server_args import settings_from_args, validate

    base = dict(device="cuda", speculative_draft_model_path=str(DRAFTER),
                speculative_num_draft_tokens=33, attention_backend="triton", page_size=1)
    monkeypatch.setenv("SGLANG_DDTREE_DEBUG", "fast_tree")
    with pytest.raises(DDTreeConfigError) as err:
        validate(server_args(**base, tp_size=2))
    assert "accepted: a comma list of host_timing" in str(err.value)
    assert "--tp-size 2 is not accepted yet" in str(err.value)
    monkeypatch.setenv("SGLANG_DDTREE_DEBUG", "torch_tree")
    validate(server_args(**base))
    s = settings_from_args(server_args(**base))
    assert (s.budget, s.block_size, s.tree_kernel) == (32, 16, "torch")


def test_set_ups_awaiting_their_gpu_check_start_only_under_the_debug_flag(monkeypatch):
    """Page size 16 was checked on a GPU against plain SGLang and is accepted; tp > 1 and the
    other page sizes up to 64 are implemented and refused until a GPU run checks them;
    SGLANG_DDTREE_DEBUG=unchecked lets that run start them, and nothing else."""
    from ddtree_sglang.sglang_plugin.server_args import validate

    base = dict(device="cuda", speculative_draft_model_path=str(DRAFTER),
                speculative_num_draft_tokens=33, attention_backend="triton")
    validate(server_args(**base, page_size=16))
    for extra, needle in ((dict(tp_size=2), "starts with SGLANG_DDTREE_DEBUG=unchecked"),
                          (dict(page_size=32), re.escape("accepted: 1, 16 (checked on a GPU"))):
        with pytest.raises(DDTreeConfigError, match=needle):
            validate(server_args(**base, **extra))
    monkeypatch.setenv("SGLANG_DDTREE_DEBUG", "unchecked")
    validate(server_args(**base, tp_size=2, page_size=32))
    with pytest.raises(DDTreeConfigError, match="--page-size 128 is not accepted"):
        validate(server_args(**base, page_size=128))  # past the implemented 64
    with pytest.raises(DDTreeConfigError, match="--pp-size 1 only"):
        validate(server_args(**base, pp_size=2))


def test_every_debug_flag_says_what_it_does():
    assert all(len(why) > 20 for why in DEBUG_FLAGS.values())


def test_a_simulated_acceptance_curve_is_read_and_must_enclose_every_candidate():
    """SGLANG_DDTREE_SIMULATE_ACC (benchmarks): budget:tau points, sorted; a bad point or a
    candidate budget outside the curve stops the server naming the accepted values (0, no
    speculation, needs no point: it commits one token)."""
    curve = settings(SGLANG_DDTREE_SIMULATE_ACC="32:9.3, 7:5.9,15:8.5").simulate_acc
    assert curve == ((7, 5.9), (15, 8.5), (32, 9.3))
    assert settings(SGLANG_DDTREE_SIMULATE_ACC="7:5.9,32:9.3",
                    SGLANG_DDTREE_BUDGETS="0,7").budgets == (0, 7, 32)
    for bad in ("32", "32:x", "0:1.0", "7:9.5", "32:0.5"):
        with pytest.raises(DDTreeConfigError, match="budget:tau points"):
            settings(SGLANG_DDTREE_SIMULATE_ACC=bad)
    with pytest.raises(DDTreeConfigError, match=r"not the server's candidate\(s\) \[7\]"):
        settings(SGLANG_DDTREE_SIMULATE_ACC="15:8.5,32:9.3")
