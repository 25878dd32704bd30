"""The decode step's host work on the CPU (bench/step_host.py), DDTREE's beside DFLASH's: Python
calls, builtin calls and aten ops per decode step, exact (tests/test_step_host.py holds batch 1
to this output), by module and function; and host µs per step and stage, which on a shared CPU
are noise.  Batch 1 / 8 / 64; DDTREE at B pinned 32 and the shipped batch-aware budget
(candidates 7, 15, 32); SGLang's DFLASH over the same stand-ins.

    python benchmarks/step_host.py --out benchmarks/results/step_host_cpu_<date>
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from ddtree_bench.step_host import VARIANTS, measure_variant  # noqa: E402
from ddtree_sglang.cli import non_negative_int, positive_int, positive_int_list  # noqa: E402


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def counts_table(rows: list[dict]) -> list[str]:
    lines = ["| step | bs | Python calls | (min-max over steps) | builtin calls | aten ops "
             "(views) | stood-in launches |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["py_calls_range"]
        lines.append(f"| {r['variant']} | {r['bs']} | {r['py_calls']:.2f} | {lo}-{hi} | "
                     f"{r['c_calls']:.2f} | {r['aten_ops']:.2f} ({r['views']:.2f}) | "
                     f"{r['stood_in_ops']:.0f} |")
    return lines


def module_table(rows: list[dict], variant: str, top: int = 10) -> list[str]:
    """Python calls per step by module: the top `top` at batch 1, at every batch size."""
    mine = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["bs"])
    first = mine[0]["py_by_module"]
    lines = [f"{variant}, Python calls per step by module (the {top} most at bs "
             f"{mine[0]['bs']}; all in the JSON):", "",
             "| module | " + " | ".join(f"bs {r['bs']}" for r in mine) + " |",
             "|---|" + "---|" * len(mine)]
    for module in list(first)[:top]:
        lines.append(f"| {module} | " + " | ".join(
            f"{r['py_by_module'].get(module, 0):g}" for r in mine) + " |")
    return lines + [""]


def timing_table(rows: list[dict]) -> list[str]:
    stages = list(next(r for r in rows if "stages_us" in r)["stages_us"])
    lines = ["| step | bs | host µs / step | " + " | ".join(stages) + " |",
             "|---|---|---|" + "---|" * len(stages)]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['bs']} | {r['host_us']:.0f} | " + " | ".join(
            f"{r['stages_us'][s]:.0f} ({r['stage_ops'][s]})" if "stages_us" in r else "-"
            for s in stages) + " |")
    return lines


def markdown(rows: list[dict], meta: dict) -> str:
    first = rows[0]
    lines = [f"# Decode-step host work on the CPU, {meta['date']}", "",
             f"Command: `{meta['command']}` (commit `{meta['commit']}`"
             f"{', with uncommitted changes' if meta['dirty'] else ''}; {meta['machine']}).",
             "",
             "Each step runs its worker's real `forward_batch_generation` on a decode batch of "
             "greedy requests (DDTreeWorker's, SGLang's DFlashWorkerV2's), with the models, "
             "kernels and SGLang's verify preparation stood in alike (bench/step_host.py says "
             "what, and what each stand-in is taken to launch).  Counts per decode step, exact "
             f"(the mean over {first['window']} steps after {first['settle']} settling steps; "
             "the batch-aware budget explores and updates its statistics on a cadence, hence "
             "the min-max): Python calls (sys.setprofile 'call' events outside stand-ins; a "
             "stand-in is one), builtin calls ('c_call': builtins, torch functions and tensor "
             "methods), aten ops dispatched outside stand-ins and graphs (views are no launch "
             "on a GPU), and the launches assumed for the stand-ins.  Not counted: the Python "
             "inside the stand-ins (model runners, graph replays, SGLang's verify preparation: "
             "one call each, for both steps).  Where a GPU run differs: DDTREE's "
             "record_stream on the batch's lengths (guarded by is_cuda) does not run here "
             "(DFLASH's does, its stream looked up through torch.cpu instead of torch.cuda): a "
             "GPU step of DDTREE makes a few more Python calls and 1 more op; DDTREE's verify "
             "mask is built here (verify_layout.full_mask: ones, index_put_ and 2 reshapes), "
             "where on a Triton target the tree stage writes it into the backend's buffer (4 "
             "ops and a Python call or two fewer).",
             ""]
    lines += counts_table(rows) + [""]
    for variant in VARIANTS:
        lines += module_table(rows, variant)
    lines += ["Top functions by Python calls per step at batch 1:", ""]
    for r in rows:
        if r["bs"] == 1:
            lines.append(f"- {r['variant']}: " + ", ".join(
                f"{name} {n:g}" for name, n in r["top_functions"][:10]))
    lines += ["", "Most frequent aten ops per step at batch 1:", ""]
    for r in rows:
        if r["bs"] == 1:
            lines.append(f"- {r['variant']}: " + ", ".join(
                f"{k} {v:g}" for k, v in list(r["ops_by_name"].items())[:10]))
    if "host_us" in first:
        lines += ["", f"Host µs per step, median over {meta['steps']} steps: NOISY (a shared "
                  "CPU, the same code moves by tens of ms between runs): no claim rests on "
                  "them.  DDTREE's per stage, with the stage's aten ops (the last step's).", ""]
        lines += timing_table(rows)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", type=positive_int_list, default=[1, 8, 64])
    ap.add_argument("--steps", type=non_negative_int, default=200,
                    help="timed steps (0: no timing)")
    ap.add_argument("--window", type=positive_int, default=32, help="counted steps")
    ap.add_argument("--settle", type=positive_int, default=128, help="steps before counting")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=time.strftime("%Y-%m-%d"), commit=git("rev-parse", "--short", "HEAD"),
                dirty=bool(git("status", "--porcelain", "--", "src", "benchmarks/ddtree_bench")),
                command="python " + " ".join(sys.argv), steps=args.steps,
                machine=f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                        f"{platform.python_version()}, torch {torch.__version__}, SGLang "
                        f"{version('sglang')}")
    rows = []
    for variant in VARIANTS:
        for bs in args.batches:
            r = measure_variant(variant, bs, steps=args.steps, window=args.window,
                                settle=args.settle)
            print(json.dumps({k: r.get(k) for k in ("variant", "bs", "py_calls", "c_calls",
                                                     "aten_ops", "host_us")}), flush=True)
            rows.append(r)
    (args.out / "step_host.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    md = markdown(rows, meta)
    (args.out / "step_host.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
