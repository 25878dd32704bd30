"""Structured output under load on one GPU: plain SGLang, DFLASH and DDTREE with each grammar
method (SGLANG_DDTREE_GRAMMAR), the same constrained requests, measured side by side.

    python benchmarks/grammar_serve.py --out $OUT/grammar                       # every cell
    python benchmarks/grammar_serve.py --out $OUT/g2 --concurrency 64 --merge-from a.json

Every arm's server starts together on the shipped testbed pair (triton attention,
--constrained-json-disable-any-whitespace: the testbed target writes code, and with free
whitespace a JSON object may never close).  Per (grammar kind, concurrency) the arms are
measured interleaved (bench/cells.py): `--rounds` rounds, each measuring every arm once after
its own warm-up, on fixed work (every arm serves the same request list, sized from a probe so the
slowest arm needs about `--seconds`).  Greedy, `/generate` with token ids.  `--null ARM` serves
ARM twice (a second server, `ARM-null`): their ratio per cell is its measured noise.
Reports output tok/s (median of rounds), each DDTREE arm's ratio to DFLASH (median of the
per-round time ratios, with their range), accept length, and every arm's greedy outputs against
plain SGLang's on the same prompts (a divergence is scored by the plain server: near-tie or
not).  Writes grammar_serve.json after every cell and grammar_serve.md at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ddtree_bench import run  # noqa: E402
from ddtree_bench.config import Arm, BenchConfig  # noqa: E402
from ddtree_bench.grammars import kind_names  # noqa: E402
from ddtree_bench.server import stop_servers_on_sigterm  # noqa: E402
from ddtree_bench.slices import (goal_lines, grammar_tax, markdown,  # noqa: E402,F401
                                 measure_slice, null_twin, ratio_to)
from ddtree_sglang.cli import positive_float, positive_int, positive_int_list  # noqa: E402

ARMS = {
    "plain": Arm(name="plain"),
    "dflash": Arm(name="dflash", algorithm="DFLASH"),
    "ddtree-tree": Arm(name="ddtree-tree", algorithm="DDTREE",
                       env={"SGLANG_DDTREE_GRAMMAR": "tree"}),
    "ddtree-path": Arm(name="ddtree-path", algorithm="DDTREE",
                       env={"SGLANG_DDTREE_GRAMMAR": "path"}),
    "ddtree-auto": Arm(name="ddtree-auto", algorithm="DDTREE",
                       env={"SGLANG_DDTREE_GRAMMAR": "auto"}),
    "ddtree-auto-spine": Arm(name="ddtree-auto-spine", algorithm="DDTREE",
                             env={"SGLANG_DDTREE_GRAMMAR": "auto",
                                  "SGLANG_DDTREE_GRAMMAR_FORCE": "spine"}),
}


def arm_names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in ARMS]
    if bad or "plain" not in names:
        raise argparse.ArgumentTypeError(
            f"unknown arm(s) {', '.join(bad) or '-'} or no 'plain' (the reference); "
            f"accepted: {', '.join(ARMS)}")
    return names


def kinds_arg(text: str) -> list[str]:
    try:
        return kind_names(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def config(args) -> BenchConfig:
    arms = [ARMS[a] for a in args.arms] + ([null_twin(ARMS[args.null])] if args.null else [])
    return BenchConfig(
        name="grammar-serve", arms=arms, concurrency=args.concurrency,
        endpoint="native", mem_fraction_static=0.4 if len(arms) <= 4 else 0.2,
        cuda_graph_max_bs=64, max_total_tokens=262144, startup_group=len(arms),
        prompts=dict(source=str(ROOT / "testbed" / "prompts.jsonl"), limit=32),
        model_path=str(ROOT / "testbed" / "target"),
        draft_model_path=str(ROOT / "testbed" / "drafter"), max_new_tokens=args.max_new_tokens,
        temperature=0.0, cell_seconds=args.seconds, repeats=args.rounds,
        warmup_per_cell=True, interleave=True)


def merge(results: dict, other: dict, adopt_meta: bool = False) -> None:
    """Add `other`'s cells (kind x concurrency) that `results` lacks, and its greedy checks
    where `results` has none; `adopt_meta`: take its header (a report-only merge)."""
    have = {(r["kind"], r["concurrency"]) for r in results["rows"]}
    results["rows"] += [dict(r, call=other["meta"]["command"]) for r in other["rows"]
                        if (r["kind"], r["concurrency"]) not in have]
    for kind, arms_ in other.get("greedy_vs_plain", {}).items():
        for arm, c in arms_.items():
            results["greedy_vs_plain"].setdefault(kind, {}).setdefault(arm, c)
    if adopt_meta:
        results["meta"] = dict(other["meta"], merged_into=results["meta"]["command"])
    else:
        results["meta"].setdefault("merged_from", []).append(other["meta"]["command"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--arms", type=arm_names, default=arm_names("plain,dflash,ddtree-tree,ddtree-path"),
                    help="comma list of " + ", ".join(ARMS) + " (plain is the reference)")
    ap.add_argument("--kinds", type=kinds_arg, default=kind_names("none,json,json_bounded,regex"),
                    help="comma list of grammar kinds (bench/grammars.py) and none")
    ap.add_argument("--concurrency", type=positive_int_list, default=[1, 16, 64])
    ap.add_argument("--seconds", type=positive_float, default=6.0,
                    help="a measurement's time: the cell's request list is sized from a probe so "
                         "the slowest arm needs about this long (4-8 s)")
    ap.add_argument("--null", choices=list(ARMS), default=None,
                    help="serve this arm twice (two servers) for the measured null")
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--max-new-tokens", type=positive_int, default=128)
    ap.add_argument("--merge-from", type=Path, nargs="*", default=[],
                    help="earlier grammar_serve.json files whose cells join this table")
    ap.add_argument("--report-only", action="store_true", help="merge and report, run nothing")
    args = ap.parse_args()
    if args.null and args.null not in args.arms:
        ap.error(f"--null {args.null}: not among --arms ({', '.join(args.arms)})")
    args.out.mkdir(parents=True, exist_ok=True)

    results = dict(meta=dict(date=time.strftime("%Y-%m-%d"), command="python "
                             + " ".join(sys.argv), commit=run.commit_id(),
                             device=run.device_name(),
                             arms=[a.name for a in config(args).arms], seconds=args.seconds,
                             rounds=args.rounds, max_new_tokens=args.max_new_tokens, work="fixed",
                             null=dict(arm=args.null, twin=null_twin(ARMS[args.null]).name)
                             if args.null else None),
                   rows=[], greedy_vs_plain={}, failures={})

    def save() -> None:
        (args.out / "grammar_serve.json").write_text(json.dumps(results, indent=1))

    if not args.report_only:
        stop_servers_on_sigterm()
        measure_slice(config(args), args.kinds, args.out, results, save, null=args.null)
    for i, path in enumerate(args.merge_from):
        merge(results, json.loads(path.read_text()), adopt_meta=args.report_only and i == 0)
    save()
    md = markdown(results)
    (args.out / "grammar_serve.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
