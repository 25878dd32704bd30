"""Structured output under load on one GPU: plain SGLang, DFLASH and DDTREE with each grammar
method (SGLANG_DDTREE_GRAMMAR), the same constrained requests, measured side by side.

    python benchmarks/grammar_serve.py --out $OUT/grammar                       # every cell
    python benchmarks/grammar_serve.py --out $OUT/g2 --concurrency 64 --merge-from a.json

Every arm's server starts together on the shipped testbed pair (triton attention,
--constrained-json-disable-any-whitespace: the testbed target writes code, and with free
whitespace a JSON object may never close).  Per (grammar kind, concurrency) the arms are
measured interleaved (bench/cells.py): `--rounds` rounds, each measuring every arm once after
its own warm-up, under sustained load for `--seconds`.  Greedy, `/generate` with token ids.
Reports output tok/s (median of rounds), each DDTREE arm's ratio to DFLASH (median of the
per-round ratios, with their range), accept length, and every arm's greedy outputs against
plain SGLang's on the same prompts (a divergence is scored by the plain server: near-tie or
not).  Writes grammar_serve.json after every cell and grammar_serve.md at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import closing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ddtree_sglang.bench import cells, client, compare, run  # noqa: E402
from ddtree_sglang.bench.config import Arm, BenchConfig  # noqa: E402
from ddtree_sglang.bench.grammars import kind_names, sampling_constraint  # noqa: E402
from ddtree_sglang.bench.server import stop_servers_on_sigterm  # noqa: E402
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
    "ddtree-python": Arm(name="ddtree-python", algorithm="DDTREE",
                         env={"SGLANG_DDTREE_GRAMMAR": "python"}),
    # auto masks, and the batch-aware budget of grammar batches from their own step costs
    "ddtree-auto-own": Arm(name="ddtree-auto-own", algorithm="DDTREE",
                           env={"SGLANG_DDTREE_GRAMMAR": "auto",
                                "SGLANG_DDTREE_GRAMMAR_BUDGET": "own"}),
    # ... and constrained rows verifying their best grammar-valid candidate nodes
    "ddtree-valid": Arm(name="ddtree-valid", algorithm="DDTREE",
                        env={"SGLANG_DDTREE_GRAMMAR": "auto",
                             "SGLANG_DDTREE_GRAMMAR_BUDGET": "own",
                             "SGLANG_DDTREE_GRAMMAR_TREE": "valid"}),
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
    return BenchConfig(
        name="grammar-serve", arms=[ARMS[a] for a in args.arms], concurrency=args.concurrency,
        endpoint="native", mem_fraction_static=0.4, cuda_graph_max_bs=64,
        max_total_tokens=262144, startup_group=len(args.arms),
        prompts=dict(source=str(ROOT / "testbed" / "prompts.jsonl"), limit=32),
        model_path=str(ROOT / "testbed" / "target"),
        draft_model_path=str(ROOT / "testbed" / "drafter"), max_new_tokens=args.max_new_tokens,
        temperature=0.0, min_cell_seconds=args.seconds, repeats=args.rounds,
        warmup_per_cell=True, interleave=True)


def measure(cfg: BenchConfig, kinds: list[str], out: Path, results: dict, save) -> None:
    """Every (kind, concurrency) cell over the arms' servers, all started together."""
    from tqdm import tqdm

    prompts = run.load_prompts(cfg)
    spec_of = lambda a: run.server_spec(cfg, a, cfg.model_path, cfg.draft_model_path,  # noqa: E731
                                        extra=["--constrained-json-disable-any-whitespace"])
    groups = run.started_groups(cfg, cfg.arms, spec_of, out)
    with closing(groups):
        group = next(groups)
        results["failures"] = {arm.name: err for arm, _, err in group if err}
        live = [(arm, [s.url for s in servers], [s.log_path for s in servers])
                for arm, servers, err in group if not err]
        plain_url = next((u[0] for a, u, _ in live if a.name == "plain"), None)
        for kind in kinds:
            params = dict(temperature=0.0, max_new_tokens=cfg.max_new_tokens,
                          ignore_eos=kind == "none", **sampling_constraint(kind))
            for arm, urls, _ in live:  # warm-up: the grammar compiled and cached per server
                client.run_level(urls, prompts, params, 2, 2, endpoint="native")
            outputs: dict[str, dict[int, list[int]]] = {}
            for conc in cfg.concurrency:
                for (arm, _, _), (res, row) in zip(live, cells.measure_interleaved(
                        cfg, live, prompts, params, conc, tqdm)):
                    results["rows"].append(dict(row, kind=kind))
                    for r in res:
                        if r.error is None:
                            outputs.setdefault(arm.name, {}).setdefault(r.prompt_index,
                                                                        r.output_ids)
                    print(json.dumps({k: row.get(k) for k in (
                        "arm", "concurrency", "output_tok_s", "rounds_tok_s",
                        "accept_length", "errors", "first_error")} | {"kind": kind}), flush=True)
                save()
            for name, outs in outputs.items():
                if name != "plain" and "plain" in outputs:
                    results["greedy_vs_plain"].setdefault(kind, {})[name] = \
                        compare.compare_to_reference(prompts, outs, outputs["plain"], plain_url)
            save()


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


def ratio_to(rows: list[dict], arm: str, base: str) -> dict | None:
    """Median and range of the per-round tok/s ratios arm / base (paired rounds)."""
    a = next((r for r in rows if r["arm"] == arm), None)
    b = next((r for r in rows if r["arm"] == base), None)
    if not a or not b or not a.get("rounds_tok_s") or not b.get("rounds_tok_s"):
        return None
    ratios = [x / y for x, y in zip(a["rounds_tok_s"], b["rounds_tok_s"]) if x and y]
    return dict(median=round(statistics.median(ratios), 3), low=round(min(ratios), 3),
                high=round(max(ratios), 3)) if ratios else None


def markdown(results: dict) -> str:
    m = results["meta"]
    arms = list(m["arms"])
    lines = [f"# Structured output under load, {m['device']}, {m['date']}", "",
             f"Command: `{m['command']}` (commit `{m['commit']}`). Testbed pair, greedy, "
             f"`/generate`, {m['max_new_tokens']} new tokens at most, cells of >= "
             f"{m['seconds']} s sustained load, {m['rounds']} interleaved rounds with a warm-up "
             "each. tok/s: median of rounds; x DFLASH: median of per-round ratios [range]; "
             "accept: accept length.", "",
             "| kind | c | " + " | ".join(arms) + " | " +
             " | ".join(f"{a} / dflash" for a in arms if a.startswith("ddtree")) +
             " | accept " + " / ".join(a for a in arms if a != "plain") + " |",
             "|---|---|" + "---|" * (len(arms) + sum(a.startswith("ddtree") for a in arms) + 1)]
    cells_ = {}
    for r in results["rows"]:
        cells_.setdefault((r["kind"], r["concurrency"]), []).append(r)
    for (kind, conc), rows in cells_.items():
        by = {r["arm"]: r for r in rows}
        tok = [f"{by[a]['output_tok_s']:,.0f}" if a in by and by[a]["output_tok_s"] else "-"
               for a in arms]
        rat = []
        for a in arms:
            if a.startswith("ddtree"):
                q = ratio_to(rows, a, "dflash")
                rat.append(f"**{q['median']:.2f}** [{q['low']:.2f}-{q['high']:.2f}]" if q else "-")
        acc = " / ".join(f"{by[a]['accept_length']:.2f}" if a in by and by[a].get(
            "accept_length") else "-" for a in arms if a != "plain")
        lines.append(f"| {kind} | {conc} | " + " | ".join(tok) + " | " + " | ".join(rat) +
                     f" | {acc} |")
    lines += ["", "Greedy outputs against plain SGLang's (identical / compared; divergences "
              "scored by the plain server: near-tie within 0.05 logprob or not):", ""]
    for kind, arms_ in results.get("greedy_vs_plain", {}).items():
        for arm, c in arms_.items():
            lines.append(f"- {kind}, {arm}: {c['identical']} / {c['identical'] + c['diverged']}"
                         f" identical; {c['diverged_at_near_tie']} near-tie, "
                         f"{c['diverged_not_tie']} not")
    lines += goal_lines(results["rows"], arms)
    if results.get("failures"):
        lines += ["", f"Arms that failed to start: {results['failures']}"]
    return "\n".join(lines) + "\n"


def grammar_tax(rows: list[dict], arm: str, kind: str, conc: int) -> float | None:
    """tok/s with the grammar / without one (kind "none"), same arm and concurrency."""
    def tok(k):
        return next((r["output_tok_s"] for r in rows if (r["arm"], r["kind"],
                     r["concurrency"]) == (arm, k, conc) and r.get("output_tok_s")), None)

    with_grammar, without = tok(kind), tok("none")
    return with_grammar / without if with_grammar and without else None


def goal_lines(rows: list[dict], arms: list[str]) -> list[str]:
    """The issue's goals per (kind, concurrency) for each DDTREE arm: >= DFLASH with the same
    grammar (median of paired rounds), >= plain at c = 1, and a grammar tax at least DFLASH's
    (where kind "none" ran on the same servers)."""
    ddtree = [a for a in arms if a.startswith("ddtree")]
    if not ddtree or "dflash" not in arms:
        return []
    lines = ["", "Goals per DDTREE arm: x DFLASH (>= 1.0), x plain at c = 1 (>= 1.0), grammar "
             "tax = tok/s with grammar / without, same server (DDTREE >= DFLASH).", "",
             "| kind | c | arm | x DFLASH | x plain | tax DDTREE / DFLASH | all met |",
             "|---|---|---|---|---|---|---|"]
    cells_ = {}
    for r in rows:
        if r["kind"] != "none":
            cells_.setdefault((r["kind"], r["concurrency"]), []).append(r)
    for (kind, conc), cell in cells_.items():
        for arm in ddtree:
            vs_dflash, vs_plain = ratio_to(cell, arm, "dflash"), ratio_to(cell, arm, "plain")
            if vs_dflash is None:
                continue
            tax, tax_dflash = grammar_tax(rows, arm, kind, conc), grammar_tax(rows, "dflash",
                                                                               kind, conc)
            checks = [vs_dflash["median"] >= 1.0]
            if conc == 1 and vs_plain is not None:
                checks.append(vs_plain["median"] >= 1.0)
            if tax is not None and tax_dflash is not None:
                checks.append(tax >= tax_dflash)
            plain_txt = f"{vs_plain['median']:.2f}" if conc == 1 and vs_plain else "-"
            tax_txt = f"{tax:.2f} / {tax_dflash:.2f}" if tax and tax_dflash else "-"
            lines.append(f"| {kind} | {conc} | {arm} | {vs_dflash['median']:.2f} | {plain_txt} "
                         f"| {tax_txt} | {'yes' if all(checks) else 'no'} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--arms", type=arm_names, default=arm_names("plain,dflash,ddtree-tree,ddtree-path"),
                    help="comma list of " + ", ".join(ARMS) + " (plain is the reference)")
    ap.add_argument("--kinds", type=kinds_arg, default=kind_names("none,json,json_bounded,regex"),
                    help="comma list of grammar kinds (bench/grammars.py) and none")
    ap.add_argument("--concurrency", type=positive_int_list, default=[1, 16, 64])
    ap.add_argument("--seconds", type=positive_float, default=4.0,
                    help="sustained load per cell")
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--max-new-tokens", type=positive_int, default=128)
    ap.add_argument("--merge-from", type=Path, nargs="*", default=[],
                    help="earlier grammar_serve.json files whose cells join this table")
    ap.add_argument("--report-only", action="store_true", help="merge and report, run nothing")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    results = dict(meta=dict(date=time.strftime("%Y-%m-%d"), command="python "
                             + " ".join(sys.argv), commit=run._meta(config(args), "", None)["commit"],
                             device=torch.cuda.get_device_name() if torch.cuda.is_available()
                             else "cpu", arms=args.arms, seconds=args.seconds,
                             rounds=args.rounds, max_new_tokens=args.max_new_tokens),
                   rows=[], greedy_vs_plain={}, failures={})

    def save() -> None:
        (args.out / "grammar_serve.json").write_text(json.dumps(results, indent=1))

    if not args.report_only:
        stop_servers_on_sigterm()
        measure(config(args), args.kinds, args.out, results, save)
    for i, path in enumerate(args.merge_from):
        merge(results, json.loads(path.read_text()), adopt_meta=args.report_only and i == 0)
    save()
    md = markdown(results)
    (args.out / "grammar_serve.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
