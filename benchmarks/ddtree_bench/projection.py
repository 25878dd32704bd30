"""Projection at real model size: which budget the chooser would pick per batch size, and the
projected DDTREE / DFLASH throughput ratio.

Inputs: cost-mode results.json files (measured step times per arm and batch, random weights)
and published accept lengths per budget.  Nothing here is a measurement of acceptance: the
output is labelled a projection.  Throughput of an arm at batch size s = s x tau / step_ms.
Several cost runs (each device call measures its own DFLASH) are joined by their ratios: a
DDTREE step is taken as (its step / its own call's DFLASH step) x the first call's DFLASH step.
Where a call measured DFLASH on several attention backends, its fastest per batch size is the
baseline (`dflash` in the joined table, the arm it came from in `dflash_arm`).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from ddtree_bench.cost_mode import fastest_chain
from ddtree_sglang.budget.controller import choose_budget

# The paper's budget curve (MATH-500, Qwen3-8B, T = 0; read from its plot) and its DFlash chain.
PAPER_TAU = {16: 8.6, 32: 9.3, 64: 9.75, 128: 10.2, 256: 10.4, 512: 10.7}
PAPER_DFLASH_TAU = 7.79


def paper_tau(budget: int) -> float | None:
    """The paper's accept length at `budget`: published, or log-linear in log2(B) between the
    two nearest published budgets (below 16: the 16-32 segment extended; above 512: None)."""
    if budget in PAPER_TAU:
        return PAPER_TAU[budget]
    points = sorted(PAPER_TAU)
    if budget > points[-1] or budget < 1:
        return None
    hi = max(points[1], next(p for p in points if p > budget))
    lo = points[points.index(hi) - 1]
    t = (math.log2(budget) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return round(PAPER_TAU[lo] + t * (PAPER_TAU[hi] - PAPER_TAU[lo]), 3)


def join_cost_runs(runs: list[list[dict]], variants: list[str] | None = None) -> list[dict]:
    """Cost rows of several calls as one table of `dflash` and `ddtree-b<B>` rows.  `variants`
    name the arm suffixes to take: "kernel" takes `ddtree-b<B>-kernel`, "default" the plain
    `ddtree-b<B>` (the default: only plain arms); a (budget, batch) met twice keeps its first
    row.  Each DDTREE step is rescaled to the first call's DFLASH (see module doc)."""
    suffixes = "|".join("" if v == "default" else "-" + re.escape(v)
                        for v in (variants or ["default"]))
    pattern = re.compile(rf"ddtree-b(\d+)(?:{suffixes})")
    reference: dict[int, float] = {}
    rows, seen = [], set()
    for cost_rows in runs:
        fastest = fastest_chain([{**r, "algorithm": r.get("algorithm") or (
            "DFLASH" if r["arm"].startswith("dflash") else None)} for r in cost_rows])
        chain = {bs: r["step_ms"] for bs, r in fastest.items()}
        for bs, ms in chain.items():
            if bs not in reference:
                reference[bs] = ms
                rows.append(dict(arm="dflash", batch_size=bs, step_ms=ms,
                                 dflash_arm=fastest[bs]["arm"]))
        for r in cost_rows:
            match = pattern.fullmatch(r["arm"])
            bs = r["batch_size"]
            if match and r.get("step_ms") and bs in chain and (match.group(1), bs) not in seen:
                seen.add((match.group(1), bs))
                rows.append(dict(arm=f"ddtree-b{match.group(1)}", batch_size=bs,
                                 step_ms=round(r["step_ms"] / chain[bs] * reference[bs], 3)))
    return rows


def project(cost_rows: list[dict], tau: dict[int, float] | None = None,
            chain_tau: float = PAPER_DFLASH_TAU) -> list[dict]:
    """One row per batch size: the chosen budget, its projected tokens/ms, DFLASH's, the ratio.
    `tau`: accept length per budget (default: `paper_tau` for every measured budget)."""
    step = {(r["arm"], r["batch_size"]): r["step_ms"] for r in cost_rows if r.get("step_ms")}
    baseline = {r["batch_size"]: r.get("dflash_arm", "dflash") for r in cost_rows
                if r["arm"] == "dflash"}
    measured = {int(a[len("ddtree-b"):]) for a, _ in step if re.fullmatch(r"ddtree-b\d+", a)}
    tau = tau or {b: t for b in measured if (t := paper_tau(b)) is not None}
    rows = []
    for bs in sorted({r["batch_size"] for r in cost_rows}):
        chain = step.get(("dflash", bs))
        budgets = [b for b in sorted(tau) if ("ddtree-b%d" % b, bs) in step]
        if chain is None or not budgets:
            continue
        ms = torch.tensor([step[("ddtree-b%d" % b, bs)] for b in budgets], dtype=torch.float64)
        accepted = torch.tensor([bs * (tau[b] - 1.0) for b in budgets], dtype=torch.float64)
        i = int(choose_budget(bs, accepted, ms))
        per_b = {b: round(bs * tau[b] / float(m), 3) for b, m in zip(budgets, ms)}
        ddtree = bs * tau[budgets[i]] / float(ms[i])
        dflash = bs * chain_tau / chain
        rows.append(dict(batch_size=bs, chosen_budget=budgets[i],
                         ddtree_tokens_per_ms=round(ddtree, 3),
                         dflash_tokens_per_ms=round(dflash, 3), dflash_arm=baseline[bs],
                         projected_ratio=round(ddtree / dflash, 3), per_budget=per_b,
                         tau={b: tau[b] for b in budgets}))
    return rows


def markdown(rows: list[dict], source: str) -> str:
    budgets = sorted({b for r in rows for b in r["per_budget"]})
    taus = {b: t for r in rows for b, t in r.get("tau", {}).items()}
    derived = [f"B={b}: {taus[b]}" for b in budgets if b in taus and b not in PAPER_TAU]
    lines = ["# PROJECTION (not a measurement): budget choice and DDTREE / DFLASH at Qwen3-8B shapes",
             "", f"Step times: `{source}` (cost mode, random weights, measured). Accept lengths: "
             f"the DDTree paper's budget curve, MATH-500, Qwen3-8B, T = 0 (B "
             + "/".join(map(str, PAPER_TAU)) + " -> tau " + "/".join(map(str, PAPER_TAU.values()))
             + f"; DFlash {PAPER_DFLASH_TAU})"
             + ("; not published, interpolated log-linearly in log2(B) from the curve: "
                + ", ".join(derived) if derived else "")
             + ". Throughput = batch x tau / step time; the chooser "
             "(`ddtree_sglang.budget.controller.choose_budget`) takes the budget with the most committed "
             "tokens per ms among the budgets measured at that batch size.", "",
             "| batch | chosen B | projected DDTREE / DFLASH | " +
             " | ".join(f"B={b} tok/ms" for b in budgets) + " | DFLASH tok/ms | DFLASH arm |",
             "|---" * (5 + len(budgets)) + "|"]
    for r in rows:
        cells = [str(r["per_budget"].get(b, "")) for b in budgets]
        lines.append(f"| {r['batch_size']} | {r['chosen_budget']} | **{r['projected_ratio']}** | "
                     + " | ".join(cells) + f" | {r['dflash_tokens_per_ms']} | "
                     f"{r.get('dflash_arm', 'dflash')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from ddtree_sglang.cli import CliError, Parser, run

    ap = Parser(prog="project_budget", description=__doc__)
    ap.add_argument("--cost", type=Path, nargs="+", required=True,
                    help="cost-mode results.json files (several calls are joined by ratio)")
    ap.add_argument("--variant", nargs="+", default=["default"],
                    help="arm suffixes to take: e.g. kernel = ddtree-b<B>-kernel, default = "
                    "plain ddtree-b<B> (several: the first file's row of a budget and batch wins)")
    ap.add_argument("--out", type=Path, help="write the markdown table here")
    args = ap.parse_args(argv)

    def body() -> int:
        runs = []
        for path in args.cost:
            try:
                runs.append(json.loads(path.read_text())["cost_rows"])
            except (OSError, ValueError, KeyError) as exc:
                raise CliError(f"--cost {path}: not a readable cost-mode results.json ({exc})")
        rows = project(join_cost_runs(runs, args.variant))
        if not rows:
            raise CliError("--cost: no batch size has both a dflash row and a DDTREE row of "
                           f"the variant(s) {', '.join(args.variant)} (arms ddtree-b<B> for "
                           "default, ddtree-b<B>-<variant> otherwise)")
        md = markdown(rows, ", ".join(map(str, args.cost)))
        if args.out:
            args.out.write_text(md)
        print(md)
        return 0
    return run(body, "project_budget")
