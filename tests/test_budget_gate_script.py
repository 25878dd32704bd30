"""scripts/budget_gate_from_logs.py on a made-up pair of server logs."""
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "budget_gate_from_logs.py"


def decode_line(running: int, accept: float, tok_s: float) -> str:
    return (f"[t] Decode batch, #running-req: {running}, #token: 9, token usage: 0.01, accept len:"
            f" {accept}, accept rate: 0.05, cuda graph: True, gen throughput (token/s): {tok_s},"
            f" #queue-req: 0\n")


def run_script(args, capsys) -> str:
    saved = sys.argv
    sys.argv = [str(SCRIPT), *args]
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        sys.argv = saved
    assert done.value.code in (0, None)
    return capsys.readouterr().out


def test_host_bound_rows_keep_the_largest_budget_and_slow_verifies_choose(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "ddtree-auto_r0_gpu0.log").write_text(
        "[t] DDTREE batch-aware budget: candidates [7, 64], verify graphs built for 1 more "
        "widths (0.1 GiB); verify ms at startup by batch size: "
        "{1: {64: 0.12, 7: 0.10}, 8: {64: 3.0, 7: 1.0}}\n")
    # batch 1: 1 x 4 tokens at 1000 tok/s = 4 ms; batch 8: 8 x 4 at 4000 tok/s = 8 ms
    (logs / "ddtree-b64_r0_gpu0.log").write_text(decode_line(1, 4.0, 1000.0) * 3
                                                  + decode_line(8, 4.0, 4000.0) * 3)
    out = run_script([str(tmp_path), "--min-lines", "3"], capsys)
    assert "| 1 | 4.00 | 0.10-0.12 | 0.50% | no |" in out  # 0.02 / 3.98
    assert "| 8 | 8.00 | 1.00-3.00 | 33.33% | yes |" in out  # 2 / 6


def test_missing_logs_are_named(tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    saved = sys.argv
    sys.argv = [str(SCRIPT), str(tmp_path)]
    try:
        with pytest.raises(SystemExit, match="needs a ddtree-auto log"):
            runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        sys.argv = saved


def test_floors_list_every_servers_periods(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "ddtree-b64_r0_gpu0.log").write_text(decode_line(8, 4.0, 4000.0) * 2
                                                  + decode_line(8, 4.0, 2000.0))
    out = run_script([str(tmp_path), "--floors", "--min-lines", "3"], capsys)
    assert "| ddtree-b64 | 8 | 3 | 8.00 | 8.00 | 4.00 | 4.00 |" in out  # periods 8, 8, 16 ms
