"""Projection at real model size: which budget the chooser would pick per batch size, and the
projected DDTREE / DFLASH throughput ratio.

Inputs: a cost-mode results.json (measured step times per arm and batch, random weights) and
published accept lengths per budget.  Nothing here is a measurement of acceptance: the output
is labelled a projection.  Throughput of an arm at batch size s = s x tau / step_ms.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddtree_sglang.budget import choose_budget

# The paper's budget curve (MATH-500, Qwen3-8B, T = 0; read from its plot) and its DFlash chain.
PAPER_TAU = {16: 8.6, 32: 9.3, 64: 9.75, 128: 10.2, 256: 10.4, 512: 10.7}
PAPER_DFLASH_TAU = 7.79


def project(cost_rows: list[dict], tau: dict[int, float] = PAPER_TAU,
            chain_tau: float = PAPER_DFLASH_TAU) -> list[dict]:
    """One row per batch size: the chosen budget, its projected tokens/ms, DFLASH's, the ratio."""
    step = {(r["arm"], r["batch_size"]): r["step_ms"] for r in cost_rows if r.get("step_ms")}
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
                         dflash_tokens_per_ms=round(dflash, 3),
                         projected_ratio=round(ddtree / dflash, 3), per_budget=per_b))
    return rows


def markdown(rows: list[dict], source: str) -> str:
    budgets = sorted({b for r in rows for b in r["per_budget"]})
    lines = ["# PROJECTION (not a measurement): budget choice and DDTREE / DFLASH at Qwen3-8B shapes",
             "", f"Step times: `{source}` (cost mode, random weights, measured). Accept lengths: "
             f"the DDTree paper's budget curve, MATH-500, Qwen3-8B, T = 0 (B "
             + "/".join(map(str, PAPER_TAU)) + " -> tau " + "/".join(map(str, PAPER_TAU.values()))
             + f"; DFlash {PAPER_DFLASH_TAU}). Throughput = batch x tau / step time; the chooser "
             "(`ddtree_sglang.budget.choose_budget`) takes the budget with the most committed "
             "tokens per ms. Budgets below 16 have no published accept length and no measured "
             "step here, so they are not candidates.", "",
             "| batch | chosen B | projected DDTREE / DFLASH | " +
             " | ".join(f"B={b} tok/ms" for b in budgets) + " | DFLASH tok/ms |",
             "|---" * (4 + len(budgets)) + "|"]
    for r in rows:
        cells = [str(r["per_budget"].get(b, "")) for b in budgets]
        lines.append(f"| {r['batch_size']} | {r['chosen_budget']} | **{r['projected_ratio']}** | "
                     + " | ".join(cells) + f" | {r['dflash_tokens_per_ms']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from ddtree_sglang.cli import CliError, Parser, run

    ap = Parser(prog="project_budget", description=__doc__)
    ap.add_argument("--cost", type=Path, required=True, help="a cost-mode results.json")
    ap.add_argument("--out", type=Path, help="write the markdown table here")
    args = ap.parse_args(argv)

    def body() -> int:
        try:
            rows = project(json.loads(args.cost.read_text())["cost_rows"])
        except (OSError, ValueError, KeyError) as exc:
            raise CliError(f"--cost {args.cost}: not a readable cost-mode results.json ({exc})")
        md = markdown(rows, str(args.cost))
        if args.out:
            args.out.write_text(md)
        print(md)
        return 0
    return run(body, "project_budget")
