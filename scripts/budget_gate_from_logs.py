"""What the batch-aware budget's gate (settings.MIN_GAIN) decides for each batch
size of a recorded serving run, from its server logs alone (no GPU needed).

    python scripts/budget_gate_from_logs.py benchmarks/results/h100_testbed_auto_2026-12-05/call3

Reads logs.tgz (or logs/) of a `ddtree-bench` run: the startup verify times that a batch-aware
server logged ("verify ms at startup by batch size"), and the step period of a fixed-budget
server at the same maximum, per batch size, from SGLang's decode log (running requests x
accept length / generation throughput; a median over the log's lines).  Prints, per batch
size, the bound budget.largest_budget_gain_bound gives and whether the choice would run.
With --floors: every server's decode period per batch size, median and quiet floor.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import tarfile
from pathlib import Path

from ddtree_bench.server_log import decode_lines, full_load_decode, step_period_ms
from ddtree_sglang.budget.controller import largest_budget_gain_bound


def read_logs(run: Path) -> dict[str, str]:
    """Server log name -> text, from run/logs.tgz or run/logs/."""
    if (run / "logs.tgz").is_file():
        with tarfile.open(run / "logs.tgz") as tar:
            return {Path(m.name).name: tar.extractfile(m).read().decode(errors="replace")
                    for m in tar.getmembers() if m.isfile() and m.name.endswith(".log")}
    return {p.name: p.read_text(errors="replace") for p in (run / "logs").glob("*.log")}


def startup_verify(text: str) -> dict[int, dict[int, float]] | None:
    for line in text.splitlines():
        if "verify ms at startup by batch size:" in line:
            return ast.literal_eval(line.split("by batch size:", 1)[1].strip())
    return None


def periods(text: str, min_lines: int) -> dict[int, float]:
    """Batch size -> median decode period (ms) over the decode-log lines of that batch size
    (unrounded: the bound of a short period moves with the last digits)."""
    seen: dict[int, list[float]] = {}
    for running, accept, tok_s in decode_lines(text):
        if tok_s > 0:
            seen.setdefault(running, []).append(step_period_ms(running, accept, tok_s))
    return {bs: statistics.median(v) for bs, v in seen.items() if len(v) >= min_lines}


def full_load_rows(text: str, min_lines: int) -> list[tuple[int, dict]]:
    """(batch size, server_log.full_load_decode) for every batch size with enough lines."""
    rows = [(bs, full_load_decode(text, bs)) for bs in sorted({n for n, _, _ in decode_lines(text)})]
    return [(bs, d) for bs, d in rows if d and d["lines"] >= min_lines]


def print_floors(logs: dict[str, str], min_lines: int) -> None:
    print("| server | batch | lines | step ms median | step ms p10 | accept len | tok/ms at p10 |")
    print("|---|---|---|---|---|---|---|")
    for name, text in sorted(logs.items()):
        for bs, d in full_load_rows(text, min_lines):
            print(f"| {name.rsplit('_r', 1)[0]} | {bs} | {d['lines']} | {d['step_ms']:.2f} | "
                  f"{d['step_ms_p10']:.2f} | {d['accept_len']:.2f} | "
                  f"{bs * d['accept_len'] / d['step_ms_p10']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a serve_bench --out folder with logs.tgz or logs/")
    ap.add_argument("--auto-arm", default="ddtree-auto")
    ap.add_argument("--fixed-arm", default="ddtree-b64", help="the fixed arm at the same maximum")
    ap.add_argument("--min-gain", type=float, default=0.03)
    ap.add_argument("--min-lines", type=int, default=10,
                    help="decode-log lines a batch size needs (fewer: warm-up noise)")
    ap.add_argument("--floors", action="store_true",
                    help="instead: every server's decode period per batch size (median and "
                         "10th percentile, the quiet floor) and accept length")
    args = ap.parse_args(argv)
    logs = read_logs(args.run)
    if args.floors:
        print_floors(logs, args.min_lines)
        return 0
    auto = next((t for n, t in logs.items() if n.startswith(args.auto_arm + "_")), None)
    fixed = next((t for n, t in logs.items() if n.startswith(args.fixed_arm + "_")), None)
    table = startup_verify(auto or "")
    if table is None or fixed is None:
        raise SystemExit(f"{args.run}: needs a {args.auto_arm} log with its startup verify times "
                         f"and a {args.fixed_arm} log; found {sorted(logs)}")
    rows = sorted(table)
    print("| batch | period ms (fixed arm) | verify ms at startup | bound | choice runs |")
    print("|---|---|---|---|---|")
    for bs, period in sorted(periods(fixed, args.min_lines).items()):
        row = table[next((r for r in rows if r >= bs), rows[-1])]
        budgets = sorted(row)
        bound = largest_budget_gain_bound([row[b] for b in budgets], period)
        print(f"| {bs} | {period:.2f} | {min(row.values()):.2f}-{row[budgets[-1]]:.2f} | "
              f"{100 * bound:.2f}% | {'yes' if bound >= args.min_gain else 'no'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
