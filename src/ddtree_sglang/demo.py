"""CPU demo: autoregressive vs DFlash chain vs DDTree on the shipped testbed pair.

    ddtree-demo                      # 4 held-out prompts, 64 new tokens, DDTree B = 32
    ddtree-demo --budget 64 --prompts 8 --temperature 1.0

Runs the pure-PyTorch reference loop (no GPU, no SGLang), prints one table (acceptance length
tau, tokens/s, tokens per target forward) and the decoded text of one sample.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    from ddtree_sglang.reference.testbed import DEFAULT_TESTBED, load_testbed
    from ddtree_sglang.sampling import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--testbed", type=Path, default=DEFAULT_TESTBED)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=32, help="DDTree tree budget B (>= 1)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    args = ap.parse_args(argv)
    if args.budget < 1:
        ap.error(f"--budget must be >= 1, got {args.budget}")
    if args.prompts < 1 or args.max_new_tokens < 1:
        ap.error("--prompts and --max-new-tokens must be >= 1")
    try:
        sampling = SamplingParams(temperature=args.temperature)
    except ValueError as exc:
        ap.error(str(exc))
    if args.threads:
        torch.set_num_threads(args.threads)
    tb = load_testbed(args.testbed)
    prompts = [tb.encode(r) for r in tb.prompts[: args.prompts]]
    modes = [("autoregressive", "ar", 0), ("DFlash chain", "chain", 0),
             (f"DDTree B={args.budget}", "ddtree", args.budget)]
    rows, sample = [], {}
    with tqdm(total=len(modes) * len(prompts), desc="generating") as bar:
        for label, mode, budget in modes:
            toks = secs = fwd = 0
            accept = []
            for i, p in enumerate(prompts):
                res = tb.speculator.generate(p, args.max_new_tokens, mode=mode,
                                             budget=max(budget, 1), sampling=sampling, seed=i)
                toks += len(res.tokens)
                secs += res.seconds
                fwd += res.target_forwards + 1  # + the prefill pass that made the first token
                accept += res.accept_lens
                sample.setdefault(label, res.tokens)
                bar.update(1)
            rows.append((label, sum(accept) / max(1, len(accept)), toks / secs, toks / fwd))
    table = Table(title=f"testbed, {len(prompts)} prompts x {args.max_new_tokens} tokens, "
                        f"temperature {args.temperature}, CPU")
    for col in ("mode", "tau (tokens / verify step)", "tokens/s", "tokens per target forward"):
        table.add_column(col, justify="right")
    for label, tau, tps, tpf in rows:
        table.add_row(label, f"{tau:.2f}", f"{tps:.1f}", f"{tpf:.2f}")
    console = Console()
    console.print(table)
    first = tb.prompts[0]
    console.print("[bold]prompt:[/bold]", first.get("prompt") or first["messages"][-1]["content"],
                  markup=True)
    console.print(f"[bold]DDTree output:[/bold] {tb.tokenizer.decode(sample[modes[2][0]])}")
    same = sample[modes[2][0]] == sample[modes[0][0]]
    if args.temperature == 0:
        console.print(f"DDTree output identical to autoregressive greedy: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
