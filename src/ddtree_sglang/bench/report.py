"""Benchmark results as a markdown table and PNG plots."""

from __future__ import annotations

from pathlib import Path


def markdown(results: dict) -> str:
    """One row per (arm, concurrency); with repeated measurements the row is the median one and
    the last columns list every measurement and their spread ((max - min) / median)."""
    meta = results["meta"]
    repeated = any("runs_tok_s" in row for row in results["rows"])
    lines = [f"# {meta['name']}: {meta['device']}, {meta['date']}", "",
             f"Command: `{meta['command']}`  ", f"Commit: `{meta.get('commit', '?')}`; "
             f"replicas: {meta['replicas']}; max_new_tokens {meta['max_new_tokens']}; "
             f"temperature {meta['temperature']}; endpoint "
             f"{(meta.get('config') or {}).get('endpoint', 'native')}", "",
             "| arm | conc/replica | output tok/s | vs no-spec | TPOT p50 ms | TPOT p90 ms | "
             "TTFT p50 ms | accept len | errors |" + (" runs tok/s | spread |" if repeated else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if repeated else "")]
    base = {row["concurrency"]: row["output_tok_s"] for row in results["rows"]
            if row["arm"] == meta.get("reference_arm")}
    for row in results["rows"]:
        ref = base.get(row["concurrency"])
        ratio = f"{row['output_tok_s'] / ref:.2f}x" if ref and row["output_tok_s"] else ""
        lines.append(f"| {row['arm']} | {row['concurrency']} | {row['output_tok_s']} | {ratio} | "
                     f"{row['tpot_p50_ms']} | {row['tpot_p90_ms']} | {row['ttft_p50_ms']} | "
                     f"{row['accept_length']} | {row['errors']} |"
                     + (f" {' / '.join(map(str, row.get('runs_tok_s', [])))} | "
                        f"{row.get('spread', '')} |" if repeated else ""))
    if results.get("correctness"):
        lines += ["", "Greedy outputs against the no-speculation arm (same prompts):", "",
                  "| arm | identical | diverged | at a near-tie | not a tie |", "|---|---|---|---|---|"]
        for arm, c in results["correctness"].items():
            lines.append(f"| {arm} | {c['identical']} | {c['diverged']} | "
                         f"{c['diverged_at_near_tie']} | {c['diverged_not_tie']} |")
    if results.get("failures"):
        lines += ["", "Arms that failed:", ""] + [f"- {k}: {v}" for k, v in results["failures"].items()]
    return "\n".join(lines) + "\n"


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
