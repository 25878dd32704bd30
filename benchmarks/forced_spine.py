"""The forced spine on the CPU (bench/forced_spine.py): the testbed pair in the reference loop
with a grammar, with and without the spine, and the spine's host cost per step with the
testbed's 4k and the real 131k vocabulary (`pip install -e '.[bench]'` for the latter).

    python benchmarks/forced_spine.py --out benchmarks/results/forced_spine_cpu_<date>
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from ddtree_bench import forced_spine as fs  # noqa: E402
from ddtree_bench.grammars import KINDS, compile_kind, kind_names  # noqa: E402
from ddtree_sglang.cli import positive_int, positive_int_list  # noqa: E402

KIND_LIST = ["tool_call", "json_bounded", "json", "regex"]


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# Forced spine on the CPU, {m['date']}", "",
             f"Command: `{m['command']}` (commit `{m['commit']}`, 2-core CPU machine). Testbed "
             f"pair in the reference loop, {m['prompts']} prompts x {m['max_new_tokens']} tokens "
             "a run; accept length = committed tokens per verify step. Spine: steps with one, "
             "its tokens proposed / accepted, steps whose first spine token the target did not "
             "choose (it tokenizes the forced string differently there).", "",
             "| kind | B | T | accept without | accept with spine | gain | spine steps | "
             "proposed / accepted | first refused | outputs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        same = r.get("equal_to_masked_ar", r.get("forced_equals_unforced"))
        what = "= masked AR" if "equal_to_masked_ar" in r else "= unforced (seeded)"
        lines.append(f"| {r['kind']} | {r['budget']} | {r['temperature']} | {r['accept_plain']:.2f}"
                     f" | {r['accept_forced']:.2f} | **{r['gain']:.2f}** | {r.get('spine_steps', 0)}"
                     f" | {r.get('spine_proposed', 0)} / {r.get('spine_accepted', 0)} | "
                     f"{r.get('spine_refused_first', 0)} | {what if same else 'DIFFER'} |")
    lines += ["", "Host cost of the spine per decode step (forced_tokens from the committed "
              "state: jump-forward string, tokenization, one accept per token and a rollback), "
              "along each kind's sample output:", "",
              "| vocabulary | kind | µs median | µs max | steps with a spine | mean spine length |",
              "|---|---|---|---|---|---|"]
    for r in res["cost"]:
        lines.append(f"| {r['vocab']} | {r['kind']} | {r['us_median']} | {r['us_max']} | "
                     f"{r['with_spine']:.0%} | {r['spine_len']} |")
    return "\n".join(lines) + "\n"


def forced_children(args, res: dict, pair, matcher_of, vocab: int) -> None:
    """Greedy rows: no spine, the spine, the spine plus forced children."""
    for kind in args.kinds:
        for budget in args.budgets:
            row = fs.run_kind(pair, matcher_of, vocab, kind, budget, args.prompts,
                              args.max_new_tokens, 0.0, tuple(fs.VARIANTS))
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
    (args.out / "children.json").write_text(json.dumps(res, indent=1))
    m = res["meta"]
    lines = [f"# Forced children on the CPU, {m['date']}", "",
             f"Command: `{m['command']}` (commit `{m['commit']}`, 2-core CPU machine). Testbed "
             f"pair in the reference loop, greedy, {m['prompts']} prompts x "
             f"{m['max_new_tokens']} tokens; accept length without the spine, with it, and with "
             "it plus forced children (a node after which the grammar admits one token gets it "
             "as its only child).", "",
             "| kind | B | no spine | spine | spine + children | outputs |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['kind']} | {r['budget']} | {r['accept_plain']:.2f} | "
                     f"{r['accept_forced']:.2f} | {r['accept_forced_children']:.2f} | "
                     f"{'= masked AR' if r['equal_to_masked_ar'] else 'DIFFER'} |")
    (args.out / "children.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kinds", type=kind_names, default=KIND_LIST)
    ap.add_argument("--budgets", type=positive_int_list, default=[15, 31])
    ap.add_argument("--prompts", type=positive_int, default=8)
    ap.add_argument("--max-new-tokens", type=positive_int, default=96)
    ap.add_argument("--children", action="store_true",
                    help="greedy only: the spine against the spine plus forced children inside "
                         "the tree (children.md); no cost table")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import xgrammar as xgr

    from ddtree_sglang.reference.testbed import load_testbed

    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "?"
    res = dict(meta=dict(date=time.strftime("%Y-%m-%d"), commit=commit, prompts=args.prompts,
                         max_new_tokens=args.max_new_tokens,
                         command="python " + " ".join(sys.argv)), rows=[], cost=[])
    pair = load_testbed()
    matcher_of, vocab = fs.testbed_grammars(pair, args.kinds)
    if args.children:
        return forced_children(args, res, pair, matcher_of, vocab)
    for kind in args.kinds:
        for budget in args.budgets:
            for temperature in (0.0, 1.0):
                row = fs.run_kind(pair, matcher_of, vocab, kind, budget, args.prompts,
                                  args.max_new_tokens, temperature)
                print(json.dumps(row), flush=True)
                res["rows"].append(row)
                (args.out / "forced_spine.json").write_text(json.dumps(res, indent=1))
    import grammar_stage  # the vocabularies of the grammar-stage benchmark

    for name, make in grammar_stage.VOCABS.items():
        try:
            v = make()
        except ImportError as exc:
            print(f"vocabulary {name} skipped: {exc}", flush=True)
            continue
        compiler = xgr.GrammarCompiler(v.info)
        for kind in args.kinds:
            matcher = xgr.GrammarMatcher(compile_kind(compiler, kind))
            cost = fs.spine_cost(matcher, v.encode(KINDS[kind].sample), v.encode)
            res["cost"].append(dict(vocab=v.name, kind=kind, **cost))
            print(json.dumps(res["cost"][-1]), flush=True)
    (args.out / "forced_spine.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (args.out / "forced_spine.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
