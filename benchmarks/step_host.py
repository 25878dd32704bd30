"""The decode step's host work on the CPU (bench/step_host.py): µs per stage and tensor ops
outside the graphed stages, per decode step, at batch 1 / 8 / 64, B pinned at 32 and the shipped
batch-aware budget (candidates 7, 15, 32).

    python benchmarks/step_host.py --out benchmarks/results/step_host_cpu_<date>
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ddtree_bench.step_host import measure  # noqa: E402
from ddtree_sglang.cli import positive_int, positive_int_list  # noqa: E402

VARIANTS = {"pinned B=32": (32,), "batch-aware 7,15,32": (7, 15, 32)}


def markdown(rows: list[dict], meta: dict) -> str:
    stages = list(rows[0]["stages_us"])
    lines = [f"# Decode-step host work on the CPU, {meta['date']}", "",
             f"Command: `{meta['command']}` (commit `{meta['commit']}`, {meta['machine']}). "
             "Median over the steps, µs per stage (aten ops in it); ops: aten ops DDTREE issues "
             "outside its graphed stages per step (bench/step_host.py says what is stood in).",
             "",
             "| variant | bs | host µs / step | " + " | ".join(stages) + " | ops / step |",
             "|---|---|---|" + "---|" * len(stages) + "---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['bs']} | {r['host_us']:.0f} | " + " | ".join(
            f"{r['stages_us'].get(s, 0):.0f} ({r['stage_ops'].get(s, 0)})" for s in stages)
            + f" | {r['ops']:.0f} |")
    lines += ["", "Most frequent ops at batch 1 (last step):", ""]
    for r in rows:
        if r["bs"] == 1:
            lines.append(f"- {r['variant']}: " + ", ".join(f"{k} {v}" for k, v in r["top_ops"]))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", type=positive_int_list, default=[1, 8, 64])
    ap.add_argument("--steps", type=positive_int, default=200)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "?"
    meta = dict(date=time.strftime("%Y-%m-%d"), commit=commit,
                command="python " + " ".join(sys.argv), machine="CPU, torch "
                + __import__("torch").__version__)
    rows = []
    for name, budgets in VARIANTS.items():
        for bs in args.batches:
            r = dict(measure(bs, max(budgets), budgets, steps=args.steps), variant=name)
            print(json.dumps({k: r[k] for k in ("variant", "bs", "host_us", "ops")}), flush=True)
            rows.append(r)
    (args.out / "step_host.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    md = markdown(rows, meta)
    (args.out / "step_host.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
