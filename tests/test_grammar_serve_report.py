"""benchmarks/grammar_serve.py's report (the serving itself needs a GPU): ratios from paired
rounds, the grammar tax from the same server's runs without a grammar, and the issue's goals
per DDTREE arm."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import grammar_serve  # noqa: E402


def row(arm: str, kind: str, conc: int, rounds: list[float]) -> dict:
    return dict(arm=arm, kind=kind, concurrency=conc, rounds_tok_s=rounds,
                output_tok_s=sorted(rounds)[len(rounds) // 2], accept_length=2.0)


def test_goals_combine_ratios_plain_at_c1_and_the_grammar_tax():
    rows = [row("plain", "json", 1, [100, 100, 100]), row("dflash", "json", 1, [90, 95, 100]),
            row("ddtree-auto", "json", 1, [110, 104, 120]),
            row("plain", "none", 1, [150, 150, 150]), row("dflash", "none", 1, [120, 120, 120]),
            row("ddtree-auto", "none", 1, [135, 135, 135]),
            row("plain", "regex", 64, [900, 900, 900]), row("dflash", "regex", 64, [500] * 3),
            row("ddtree-auto", "regex", 64, [450, 480, 470])]
    assert grammar_serve.ratio_to(rows[:3], "ddtree-auto", "dflash") == dict(
        median=1.2, low=1.095, high=1.222)  # 110/90, 104/95, 120/100, paired by round
    assert round(grammar_serve.grammar_tax(rows, "ddtree-auto", "json", 1), 3) == 0.815
    assert grammar_serve.grammar_tax(rows, "ddtree-auto", "regex", 64) is None  # no "none" run
    lines = grammar_serve.goal_lines(rows, ["plain", "dflash", "ddtree-auto"])
    json_line = next(x for x in lines if x.startswith("| json | 1 |"))
    # x DFLASH 1.20, x plain 1.10 at c = 1, tax 0.81 (110 / 135) vs DFLASH's 0.79 (95 / 120)
    assert json_line == "| json | 1 | ddtree-auto | 1.20 | 1.10 | 0.81 / 0.79 | yes |"
    regex_line = next(x for x in lines if x.startswith("| regex | 64 |"))
    assert regex_line.endswith("| 0.94 | - | - | no |")
    assert grammar_serve.goal_lines(rows, ["plain", "ddtree-auto"]) == []  # no DFLASH arm
