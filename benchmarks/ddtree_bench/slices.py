"""Measuring a slice: every arm of a set of (grammar kind, concurrency) cells, interleaved on one
machine, with the same servers for every cell, so that the ratios inside a slice (DDTREE / DFLASH,
/ plain, the grammar tax against the same servers' runs without a grammar) are paired.

Every cell is fixed work (bench/cells.py): each arm serves the same request list, sized from a
probe, and its ratios are ratios of the times to finish it.  A slice may carry a measured null:
one arm served twice, by two servers started with the others (`<arm>` and `<arm>-null`); their
ratio in a cell is that cell's noise, and a cell whose null lies outside NULL_BAND says nothing
at that precision.

Cells run concurrency by concurrency, each kind at that level before the next level, so a slice
cut short by its deadline still holds whole (kind, none) pairs for the tax.  A cell starts only if
its estimated time fits before `stop_at`; the cells left out are named in the results.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Callable

from ddtree_bench import cells, client, compare, run
from ddtree_bench.config import Arm, BenchConfig
from ddtree_bench.grammars import sampling_constraint

REFERENCE_ARM = "plain"
NULL_SUFFIX = "-null"
NULL_BAND = (0.95, 1.05)  # a null outside it: the cell's ratios are noise at the 5% level


def null_twin(arm: Arm) -> Arm:
    """The null's second server: the same arm under the name `<arm>-null`."""
    return arm.model_copy(update=dict(name=arm.name + NULL_SUFFIX))


def is_twin(name: str) -> bool:
    return name.endswith(NULL_SUFFIX)


def kind_params(cfg: BenchConfig, kind: str) -> dict:
    """Greedy request parameters of one grammar kind ('none': unconstrained, EOS ignored so
    every request runs to max_new_tokens; with a grammar the request ends where the grammar
    does, the same place for every arm at greedy)."""
    return dict(temperature=0.0, max_new_tokens=cfg.max_new_tokens, ignore_eos=kind == "none",
                **sampling_constraint(kind))


def measure_slice(cfg: BenchConfig, kinds: list[str], out: Path, results: dict,
                  save: Callable[[], None], stop_at: float | None = None,
                  null: str | None = None, log: Callable[[str], None] = print,
                  null_on_own_server: bool = False) -> None:
    """Start every arm's server together, then measure each (concurrency, kind) cell
    interleaved, appending rows (with `kind`) to results["rows"]; greedy outputs of each arm are
    compared with the reference arm's per kind.  `null`: the arm whose twin (`<null>-null`) is
    among cfg.arms; its ratio per cell goes to results["null"].  Cells that would run past
    `stop_at` (time.monotonic()) are not started and are listed in results["cells_skipped"].
    Servers that did not start go to results["failures"], those dead by the end to
    results["not_alive_at_end"] (either fails the slice).  With `null_on_own_server` the twin
    has no server of its own: the null's server is measured twice in each round.  With
    cfg.random_weights the servers serve the cost mode's random pair and random prompts.  Logs
    one line per measurement and one per cell."""
    if cfg.random_weights:
        model, drafter, prompts = run.random_inputs(cfg)
        extra = ["--skip-tokenizer-init"]
    else:
        model, drafter, prompts = cfg.model_path, cfg.draft_model_path, run.load_prompts(cfg)
        extra = ["--constrained-json-disable-any-whitespace"]
    spec_of = lambda a: run.server_spec(cfg, a, model, drafter, extra=extra)  # noqa: E731
    t0 = time.monotonic()
    groups = run.started_groups(cfg, cfg.arms, spec_of, out)
    with closing(groups):
        group = next(groups)
        results["startup_s"] = round(time.monotonic() - t0, 1)
        results["failures"] = {arm.name: err for arm, _, err in group if err}
        log(f"servers up after {results['startup_s']:.0f} s"
            + (f"; failed: {', '.join(results['failures'])}" if results["failures"] else ""))
        live = [(arm, [s.url for s in servers], [s.log_path for s in servers])
                for arm, servers, err in group if not err]
        if null and null_on_own_server:  # the twin: the null's own server, measured again
            live += [(null_twin(arm), urls, logs) for arm, urls, logs in live if arm.name == null]
        ref_url = next((u[0] for a, u, _ in live if a.name == REFERENCE_ARM), None)
        outputs: dict[str, dict[str, dict[int, list[int]]]] = {k: {} for k in kinds}
        warmed: set[str] = set()
        estimate = cells.cell_estimate(cfg, len(live)) or 0.0
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
                measured = cells.measure_interleaved(cfg, live, prompts, params, conc,
                                                     log=lambda line: log(f"{kind:<12} {line}"))
                rows = []
                for (arm, _, _), (res, row) in zip(live, measured):
                    rows.append(dict(row, kind=kind))
                    for r in res:
                        if r.error is None:
                            outputs[kind].setdefault(arm.name, {}).setdefault(
                                r.prompt_index, r.output_ids)
                results["rows"] += rows
                if null:
                    results["null"] = null_summary(results["rows"], null)
                log(cell_line(kind, conc, rows, null))
                save()
        for kind, outs in outputs.items():
            for name, arm_outs in outs.items():
                if name != REFERENCE_ARM and REFERENCE_ARM in outs:
                    results["greedy_vs_plain"].setdefault(kind, {})[name] = \
                        compare.compare_to_reference(prompts, arm_outs, outs[REFERENCE_ARM],
                                                     ref_url)
        results["not_alive_at_end"] = [arm.name for arm, servers, err in group
                                       if not err and not all(s.alive() for s in servers)]
        save()


def ratio_to(rows: list[dict], arm: str, base: str) -> dict | None:
    """How much faster `arm` served the cell than `base`: median and range of the per-round
    ratios base's time / arm's time (paired rounds of the same request list).  Rows measured
    before cells had fixed work (no rounds_wall_s) give their tok/s ratios."""
    a = next((r for r in rows if r["arm"] == arm), None)
    b = next((r for r in rows if r["arm"] == base), None)
    if not a or not b:
        return None
    if a.get("rounds_wall_s") and b.get("rounds_wall_s"):
        ratios = [y / x for x, y in zip(a["rounds_wall_s"], b["rounds_wall_s"]) if x and y]
    elif a.get("rounds_tok_s") and b.get("rounds_tok_s"):
        ratios = [x / y for x, y in zip(a["rounds_tok_s"], b["rounds_tok_s"]) if x and y]
    else:
        return None
    return dict(median=round(statistics.median(ratios), 3), low=round(min(ratios), 3),
                high=round(max(ratios), 3)) if ratios else None


def null_ratio(rows: list[dict], null: str) -> dict | None:
    """The cell's null: the null arm against its twin (ratio_to), with `quiet` when its median
    lies inside NULL_BAND."""
    q = ratio_to(rows, null, null + NULL_SUFFIX)
    if q is None:
        return None
    return dict(q, quiet=NULL_BAND[0] <= q["median"] <= NULL_BAND[1])


def null_summary(rows: list[dict], null: str) -> dict:
    """The slice's null: per cell ("kind@c") its ratio, and the one farthest from 1 (the
    slice's noise); `noisy` names the cells outside NULL_BAND (they do not count)."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(f"{r['kind']}@{r['concurrency']}", []).append(r)
    per = {key: q for key, cell in by.items() if (q := null_ratio(cell, null))}
    worst = max(per.values(), key=lambda q: abs(q["median"] - 1.0), default=None)
    return dict(arm=null, twin=null + NULL_SUFFIX, band=list(NULL_BAND), cells=per,
                worst=worst["median"] if worst else None,
                noisy=[k for k, q in per.items() if not q["quiet"]])


def cell_line(kind: str, conc: int, rows: list[dict], null: str | None) -> str:
    """The log's line after a cell: its work, the null and every DDTREE arm's time ratio to
    DFLASH."""
    work = rows[0]
    parts = [f"cell {kind}@{conc}: {work['requests']} requests"]
    if null:
        q = null_ratio(rows, null)
        parts.append("null -" if q is None else
                     f"null {q['median']:.3f}" + ("" if q["quiet"] else " NOISY"))
    for r in rows:
        if r["arm"].startswith("ddtree") and not is_twin(r["arm"]):
            q = ratio_to(rows, r["arm"], "dflash")
            if q:
                parts.append(f"{r['arm']} x dflash {q['median']:.3f}")
    return "; ".join(parts)


def grammar_tax(rows: list[dict], arm: str, kind: str, conc: int) -> float | None:
    """tok/s with the grammar / without one (kind "none"), same arm and concurrency."""
    def tok(k):
        return next((r["output_tok_s"] for r in rows if (r["arm"], r["kind"],
                     r["concurrency"]) == (arm, k, conc) and r.get("output_tok_s")), None)

    with_grammar, without = tok(kind), tok("none")
    return with_grammar / without if with_grammar and without else None


def _ratio_text(q: dict | None) -> str:
    return f"**{q['median']:.2f}** [{q['low']:.2f}-{q['high']:.2f}]" if q else "-"


def _null_text(rows: list[dict], null: str | None) -> str:
    q = null_ratio(rows, null) if null else None
    if q is None:
        return "-"
    return f"{q['median']:.3f} [{q['low']:.3f}-{q['high']:.3f}]" + (
        "" if q["quiet"] else " **noisy**")


def markdown(results: dict, preface: Sequence[str] = ()) -> str:
    """The slice's report; `preface`: lines put first under its title (why it failed)."""
    m = results["meta"]
    arms = list(m["arms"])
    null = (m.get("null") or {}).get("arm")
    ddtree = [a for a in arms if a.startswith("ddtree") and not is_twin(a)]
    fixed = any(r.get("rounds_wall_s") for r in results["rows"])
    work = (f"fixed work: every arm of a cell serves the same request list (sized so the slowest "
            f"arm needs about {m['seconds']} s), tok/s = its output tokens / the time to finish "
            "it; x DFLASH: median of the per-round time ratios [range]" if fixed else
            f"cells of >= {m['seconds']} s sustained load; x DFLASH: median of per-round tok/s "
            "ratios [range]")
    pair = "Testbed pair" if m.get("shapes", "testbed") == "testbed" else (
        "Qwen3-8B shapes (random weights, random prompts), forced acceptance "
        + ", ".join(f"{a} {v}" for a, v in (m.get("simulate") or {}).items()))
    lines = [f"# Serving under load, {m['device']}, {m['date']}", "",
             f"Command: `{m['command']}` (commit `{m['commit']}`). {pair}, greedy, "
             f"`/generate`, {m['max_new_tokens']} new tokens at most, {m['rounds']} interleaved "
             f"rounds with a warm-up each; {work}; accept: accept length.", "", *preface]
    summary = results.get("null")
    if null and summary:
        noisy = summary["noisy"]
        against = ("its own server measured a second time in each round"
                   if (m.get("null") or {}).get("server") == "same" else
                   "a second server of itself")
        lines += [f"Null: `{null}` against {against} (`{summary['twin']}`), "
                  f"median of the per-round time ratios; worst cell {summary['worst']}; "
                  + (f"**noisy (outside {NULL_BAND[0]}-{NULL_BAND[1]}): {', '.join(noisy)}** "
                     "- those cells do not count" if noisy else
                     f"every cell within {NULL_BAND[0]}-{NULL_BAND[1]}") + ".", ""]
    elif not null:
        lines += ["No null in this slice (no arm served twice): its ratios carry no measured "
                  "noise.", ""]
    lines += ["| kind | c | requests | " + " | ".join(arms) + " | null | " +
              " | ".join(f"{a} / dflash" for a in ddtree) +
              " | accept " + " / ".join(a for a in arms if a != "plain" and not is_twin(a)) + " |",
              "|---|---|---|" + "---|" * (len(arms) + len(ddtree) + 2)]
    cells_ = {}
    for r in results["rows"]:
        cells_.setdefault((r["kind"], r["concurrency"]), []).append(r)
    for (kind, conc), rows in cells_.items():
        by = {r["arm"]: r for r in rows}
        tok = [f"{by[a]['output_tok_s']:,.0f}" if a in by and by[a]["output_tok_s"] else "-"
               for a in arms]
        rat = [_ratio_text(ratio_to(rows, a, "dflash")) for a in ddtree]
        acc = " / ".join(f"{by[a]['accept_length']:.2f}" if a in by and by[a].get(
            "accept_length") else "-" for a in arms if a != "plain" and not is_twin(a))
        lines.append(f"| {kind} | {conc} | {rows[0].get('requests', '-')} | " + " | ".join(tok)
                     + f" | {_null_text(rows, null)} | " + " | ".join(rat) + f" | {acc} |")
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
    ddtree = [a for a in arms if a.startswith("ddtree") and not is_twin(a)]
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
