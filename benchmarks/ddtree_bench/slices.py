"""Measuring a slice: every arm of a set of (grammar kind, concurrency) cells, interleaved on one
machine, with the same servers for every cell, so that the ratios inside a slice (DDTREE / DFLASH,
/ plain, the grammar tax against the same servers' runs without a grammar) are paired.

Cells run concurrency by concurrency, each kind at that level before the next level, so a slice
cut short by its deadline still holds whole (kind, none) pairs for the tax.  A cell starts only if
its estimated time fits before `stop_at`; the cells left out are named in the results.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import closing
from pathlib import Path
from typing import Callable

from ddtree_bench import cells, client, compare, run
from ddtree_bench.config import BenchConfig
from ddtree_bench.grammars import sampling_constraint

REFERENCE_ARM = "plain"
WARMUP_S = 1.5  # per measurement: its warm-up round and the drain of the last requests


def cell_seconds(cfg: BenchConfig, n_arms: int) -> float:
    """Estimated wall time of one interleaved cell: every arm, every round, warm-up included."""
    return n_arms * cfg.repeats * (cfg.min_cell_seconds + WARMUP_S)


def kind_params(cfg: BenchConfig, kind: str) -> dict:
    """Greedy request parameters of one grammar kind ('none': unconstrained, EOS ignored so
    every request runs to max_new_tokens)."""
    return dict(temperature=0.0, max_new_tokens=cfg.max_new_tokens, ignore_eos=kind == "none",
                **sampling_constraint(kind))


def measure_slice(cfg: BenchConfig, kinds: list[str], out: Path, results: dict,
                  save: Callable[[], None], stop_at: float | None = None) -> None:
    """Start every arm's server together, then measure each (concurrency, kind) cell
    interleaved, appending rows (with `kind`) to results["rows"]; greedy outputs of each arm are
    compared with the reference arm's per kind.  Cells that would run past `stop_at`
    (time.monotonic()) are not started and are listed in results["cells_skipped"]."""
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
        ref_url = next((u[0] for a, u, _ in live if a.name == REFERENCE_ARM), None)
        outputs: dict[str, dict[str, dict[int, list[int]]]] = {k: {} for k in kinds}
        warmed: set[str] = set()
        estimate = cell_seconds(cfg, len(live))
        skipped = results.setdefault("cells_skipped", [])
        for conc in cfg.concurrency:
            for kind in kinds:
                if stop_at is not None and time.monotonic() + estimate > stop_at:
                    skipped.append(dict(kind=kind, concurrency=conc))
                    continue
                params = kind_params(cfg, kind)
                if kind not in warmed:  # the grammar compiled and cached on every server
                    for _, urls, _ in live:
                        client.run_level(urls, prompts, params, 2, 2, endpoint=cfg.endpoint)
                    warmed.add(kind)
                for (arm, _, _), (res, row) in zip(live, cells.measure_interleaved(
                        cfg, live, prompts, params, conc, tqdm)):
                    results["rows"].append(dict(row, kind=kind))
                    for r in res:
                        if r.error is None:
                            outputs[kind].setdefault(arm.name, {}).setdefault(
                                r.prompt_index, r.output_ids)
                    print(json.dumps({k: row.get(k) for k in (
                        "arm", "concurrency", "output_tok_s", "rounds_tok_s",
                        "accept_length", "errors", "first_error")} | {"kind": kind}), flush=True)
                save()
        for kind, outs in outputs.items():
            for name, arm_outs in outs.items():
                if name != REFERENCE_ARM and REFERENCE_ARM in outs:
                    results["greedy_vs_plain"].setdefault(kind, {})[name] = \
                        compare.compare_to_reference(prompts, arm_outs, outs[REFERENCE_ARM],
                                                     ref_url)
        save()


def ratio_to(rows: list[dict], arm: str, base: str) -> dict | None:
    """Median and range of the per-round tok/s ratios arm / base (paired rounds)."""
    a = next((r for r in rows if r["arm"] == arm), None)
    b = next((r for r in rows if r["arm"] == base), None)
    if not a or not b or not a.get("rounds_tok_s") or not b.get("rounds_tok_s"):
        return None
    ratios = [x / y for x, y in zip(a["rounds_tok_s"], b["rounds_tok_s"]) if x and y]
    return dict(median=round(statistics.median(ratios), 3), low=round(min(ratios), 3),
                high=round(max(ratios), 3)) if ratios else None


def grammar_tax(rows: list[dict], arm: str, kind: str, conc: int) -> float | None:
    """tok/s with the grammar / without one (kind "none"), same arm and concurrency."""
    def tok(k):
        return next((r["output_tok_s"] for r in rows if (r["arm"], r["kind"],
                     r["concurrency"]) == (arm, k, conc) and r.get("output_tok_s")), None)

    with_grammar, without = tok(kind), tok("none")
    return with_grammar / without if with_grammar and without else None


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
