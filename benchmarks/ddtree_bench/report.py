"""Benchmark results as a markdown table and PNG plots."""

from __future__ import annotations

import statistics
from pathlib import Path


def markdown(results: dict) -> str:
    """One row per (arm, concurrency); with repeated measurements the row is the median one and
    the last columns list every measurement and their spread ((max - min) / median)."""
    meta = results["meta"]
    repeated = any("runs_tok_s" in row for row in results["rows"])
    server = any(row.get("server_decode") for row in results["rows"])
    lines = [f"# {meta['name']}: {meta['device']}, {meta['date']}", "",
             f"Command: `{meta['command']}`  ", f"Commit: `{meta.get('commit', '?')}`; "
             f"replicas: {meta['replicas']}; max_new_tokens {meta['max_new_tokens']}; "
             f"temperature {meta['temperature']}; endpoint "
             f"{(meta.get('config') or {}).get('endpoint', 'native')}", "",
             "| arm | conc/replica | output tok/s | vs no-spec | TPOT p50 ms | TPOT p90 ms | "
             "TTFT p50 ms | accept len | errors |" + (" runs tok/s | spread |" if repeated else "")
             + (" server step ms (p10) | server tok/s |" if server else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if repeated else "")
             + ("---|---|" if server else "")]
    base = {row["concurrency"]: row["output_tok_s"] for row in results["rows"]
            if row["arm"] == meta.get("reference_arm")}
    for row in results["rows"]:
        ref = base.get(row["concurrency"])
        ratio = f"{row['output_tok_s'] / ref:.2f}x" if ref and row["output_tok_s"] else ""
        lines.append(f"| {row['arm']} | {row['concurrency']} | {row['output_tok_s']} | {ratio} | "
                     f"{row['tpot_p50_ms']} | {row['tpot_p90_ms']} | {row['ttft_p50_ms']} | "
                     f"{row['accept_length']} | {row['errors']} |"
                     + (f" {' / '.join(map(str, row.get('runs_tok_s', [])))} | "
                        f"{row.get('spread', '')} |" if repeated else "")
                     + (_server_cells(row) if server else ""))
    lines += budget_verdict(results["rows"])
    if results.get("correctness"):
        lines += ["", "Greedy outputs against the no-speculation arm (same prompts):", "",
                  "| arm | identical | diverged | at a near-tie | not a tie |", "|---|---|---|---|---|"]
        for arm, c in results["correctness"].items():
            lines.append(f"| {arm} | {c['identical']} | {c['diverged']} | "
                         f"{c['diverged_at_near_tie']} | {c['diverged_not_tie']} |")
    if results.get("failures"):
        lines += ["", "Arms that failed:", ""] + [f"- {k}: {v}" for k, v in results["failures"].items()]
    return "\n".join(lines) + "\n"


def _server_cells(row: dict) -> str:
    """The median measurement's decode step period (median, 10th percentile) and tokens/s
    from the server's own log at full load (bench/server_log.py), and its number of lines."""
    d = row.get("server_decode")
    if not d:
        return "  |  |"
    return (f" {d['step_ms']} ({d.get('step_ms_p10', '')}; {d['lines']} lines) | "
            f"{d['gen_tok_s']} |")


# The bar: the judged DDTREE arm within 3% of the best other speculative arm at every level.
# The judged arm is the shipped defaults (ddtree-default) where a run has one, else the
# batch-aware budget arm of older runs (ddtree-auto).
VERDICT_ARMS, AUTO_MARGIN = ("ddtree-default", "ddtree-auto"), 0.97


def budget_verdict(rows: list[dict]) -> list[str]:
    """Markdown lines: per concurrency, the judged arm's tokens/s against the best other
    arm's and DFLASH's measured at that concurrency (in the same call: a run split over calls
    by concurrency keeps every level's arms side by side).  Empty without a judged arm."""
    present = {r["arm"] for r in rows}
    judged = next((a for a in VERDICT_ARMS if a in present), None)
    levels = sorted({r["concurrency"] for r in rows if r["arm"] == judged})
    if not levels:
        return []
    out = ["", f"`{judged}` against the best other speculative arm at each concurrency "
           f"(bar: >= {AUTO_MARGIN}x):", "",
           f"| concurrency | {judged} tok/s | best other arm | its tok/s | {judged} / best | "
           f"{judged} / DFLASH | >= bar | steady state: {judged} / best (arm) | rounds: "
           f"{judged} / best of round | call |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for c in levels:
        at = {r["arm"]: r for r in rows if r["concurrency"] == c and r.get("output_tok_s")}
        auto = at.get(judged)
        others = [r for a, r in at.items() if a != judged and r.get("algorithm")]
        if auto is None or not others:
            continue
        best = max(others, key=lambda r: r["output_tok_s"])
        ratio = auto["output_tok_s"] / best["output_tok_s"]
        dflash = next((r for r in others if r.get("algorithm") == "DFLASH"), None)
        vs_chain = f"{auto['output_tok_s'] / dflash['output_tok_s']:.3f}" if dflash else ""
        out.append(f"| {c} | {auto['output_tok_s']} | {best['arm']} | {best['output_tok_s']} | "
                   f"{ratio:.3f} | {vs_chain} | {'yes' if ratio >= AUTO_MARGIN else '**no**'} | "
                   f"{_steady_ratio(auto, others)} | {_round_ratios(auto, others)} | "
                   f"{auto.get('call', 'this run')}"
                   + (" (the best arm's: another call)" if best.get("call") != auto.get("call")
                      else "") + " |")
    return out


def _steady_ratio(auto: dict, others: list[dict]) -> str:
    """auto's steady-state tokens/s over the best other arm's (client.steady_tok_s), or ''."""
    rated = [r for r in others if r.get("steady_tok_s")]
    if not auto.get("steady_tok_s") or not rated:
        return ""
    best = max(rated, key=lambda r: r["steady_tok_s"])
    return f"{auto['steady_tok_s'] / best['steady_tok_s']:.3f} ({best['arm']})"


def _round_ratios(auto: dict, others: list[dict]) -> str:
    """Interleaved runs (bench/cells.py): per round, auto's tokens/s over the best other arm's
    in that same round; the median and the range over rounds, or '' where the arms were not
    measured in the same rounds (another call, or not interleaved)."""
    rounds = auto.get("rounds_tok_s")
    paired = [r["rounds_tok_s"] for r in others if r.get("rounds_tok_s")
              and len(r["rounds_tok_s"]) == len(rounds or ()) and r.get("call") == auto.get("call")]
    if not rounds or len(paired) != len(others):
        return ""
    ratios = [a / max(o[i] for o in paired) for i, a in enumerate(rounds)]
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"


def plots(results: dict, out_dir: Path) -> list[Path]:
    """Throughput and TPOT against concurrency, one line per arm (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    arms = sorted({r["arm"] for r in results["rows"]}, key=str)
    written = []
    for key, label, fname in [("output_tok_s", "output tokens/s (all replicas)", "throughput.png"),
                              ("tpot_p50_ms", "TPOT p50 (ms)", "tpot.png")]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for arm in arms:
            rows = [r for r in results["rows"] if r["arm"] == arm and r.get(key) is not None]
            ax.plot([r["concurrency"] for r in rows], [r[key] for r in rows], marker="o", label=arm)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency per replica")
        ax.set_ylabel(label)
        ax.set_title(f"{results['meta']['name']} ({results['meta']['device']})")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
