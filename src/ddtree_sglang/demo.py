"""CPU demo: autoregressive vs DFlash chain vs DDTree on the shipped testbed pair.

    ddtree-demo                      # 4 held-out prompts, 64 new tokens, DDTree B = 32
    ddtree-demo --budget 64 --prompts 8 --temperature 1.0
    ddtree-demo --auto-budgets 7,15,32   # + DDTree with the budget chosen per step

Runs the pure-PyTorch reference loop (no GPU, no SGLang), prints one table (accept length,
tokens/s, tokens per target forward) and the decoded text of one sample.  Every limit is
checked before generating: the budget against the tree's distinct prefixes and this machine's
free memory, the output length against the target's positions.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from ddtree_sglang.cli import (CliError, Parser, finite_float, non_negative_int, positive_int,
                               positive_int_list, run)

PROG = "ddtree-demo"


def free_memory_bytes() -> int:
    """Memory available to this process now (Linux: MemAvailable), or a large number."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def verify_bytes(budget: int, context: int, config) -> int:
    """Rough peak of one tree verify in the float32 reference loop: logits and softmax copies
    over the vocabulary, attention scores and masks over the context, per tree node."""
    width = budget + 1
    heads = int(getattr(config, "num_attention_heads", 8))
    return width * 4 * (4 * int(config.vocab_size) + 3 * heads * (context + width))


def check_limits(args, tb, prompts: list[list[int]], budget: int, flag: str = "--budget") -> None:
    """`budget` (given as `flag`) and the output length against the tree, the target's
    positions and this machine's free memory."""
    from ddtree_sglang.tree.builder import check_budget

    spec = tb.speculator
    depth, vocab = spec.cfg.block_size - 1, int(spec.target.config.vocab_size)
    try:
        check_budget(budget, depth, vocab)
    except ValueError as exc:
        raise CliError(f"{flag} {budget}: {exc}") from None
    longest = max(len(p) for p in prompts)
    room = spec.max_new_tokens_for(longest)
    if args.max_new_tokens > room:
        raise CliError(f"--max-new-tokens {args.max_new_tokens}: the longest selected prompt has "
                       f"{longest} tokens and the target {spec.max_positions} positions; "
                       f"accepted: 1..{room}")
    context = longest + args.max_new_tokens + spec.cfg.block_size
    free = free_memory_bytes()
    need = verify_bytes(budget, context, spec.target.config)
    if need > free // 2:
        fits = max(b for b in range(1, budget + 1)
                   if b == 1 or verify_bytes(b, context, spec.target.config) <= free // 2)
        raise CliError(f"{flag} {budget}: one tree verify needs about {need / 2**30:.1f} "
                       f"GiB here and {free / 2**30:.1f} GiB is free; accepted on this machine: "
                       f"1..{fits}")


def step_costs_here(spec, prompt: list[int], budgets: list[int], sampling) -> dict[int, float]:
    """Milliseconds per decode step of the reference loop at each budget, timed on this machine
    (16 tokens of `prompt` each): the cost side of the per-step budget choice."""
    costs = {}
    for b in budgets:
        res = spec.generate(prompt, 16, mode="ddtree", budget=b, sampling=sampling)
        costs[b] = 1000.0 * res.seconds / (res.target_forwards + 1)  # the prefill included
    return costs


def main(argv: list[str] | None = None) -> int:
    return run(lambda: _main(argv), PROG)


def _main(argv: list[str] | None) -> int:
    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    from ddtree_sglang.reference.testbed import (WHERE_TESTBED, TestbedError, find_testbed,
                                                 load_testbed)
    from ddtree_sglang.sampling.sample import SamplingParams

    ap = Parser(prog=PROG, description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--testbed", type=Path, default=None,
                    help="folder with target/, drafter/, prompts.jsonl (default: testbed/ of "
                         "the clone this package runs or was installed from)")
    ap.add_argument("--prompts", type=positive_int, default=4, help="how many prompts (from the top)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=64)
    ap.add_argument("--budget", type=positive_int, default=32, help="DDTree tree budget B")
    ap.add_argument("--auto-budgets", type=positive_int_list, default=None,
                    help="also run DDTree choosing, per step, the budget among these with the "
                         "most tokens per ms (step costs timed here first; budget/controller.py)")
    ap.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy")
    ap.add_argument("--threads", type=non_negative_int, default=0,
                    help="torch CPU threads (0 = torch's default)")
    args = ap.parse_args(argv)
    args.testbed = args.testbed or find_testbed()
    if args.testbed is None:
        raise CliError(f"no testbed found (a folder with target/, drafter/ and prompts.jsonl);"
                       f" {WHERE_TESTBED}")
    try:
        sampling = SamplingParams(temperature=args.temperature)
    except ValueError as exc:
        raise CliError(f"--temperature: {exc}") from None
    if args.threads:
        torch.set_num_threads(min(args.threads, os.cpu_count() or args.threads))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weight-loading bars would bury the table
    try:
        tb = load_testbed(args.testbed)
    except TestbedError as exc:
        raise CliError(f"--testbed: {exc}") from None
    if args.prompts > len(tb.prompts):
        raise CliError(f"--prompts {args.prompts}: {args.testbed / 'prompts.jsonl'} holds "
                       f"{len(tb.prompts)}; accepted: 1..{len(tb.prompts)}")
    prompts = [tb.encode(r) for r in tb.prompts[: args.prompts]]
    if min(len(p) for p in prompts) == 0:
        raise CliError(f"{args.testbed / 'prompts.jsonl'}: a selected prompt encodes to no tokens")
    check_limits(args, tb, prompts, args.budget)
    modes = [("autoregressive", "ar", 0), ("DFlash chain", "chain", 0),
             (f"DDTree B={args.budget}", "ddtree", args.budget)]
    if args.auto_budgets:
        from ddtree_sglang.budget.controller import BudgetController, StepCosts

        budgets = sorted(set(args.auto_budgets))
        check_limits(args, tb, prompts, budgets[-1], "--auto-budgets")
        costs = step_costs_here(tb.speculator, prompts[0], budgets, sampling)
        controller = BudgetController(budgets, StepCosts({1: costs}),
                                      tb.speculator.cfg.block_size - 1, tb.speculator.device)
        modes.append(("DDTree auto " + "/".join(map(str, budgets)), "ddtree", controller))
    rows, sample = [], {}
    with tqdm(total=len(modes) * len(prompts), desc="generating") as bar:
        for label, mode, budget in modes:
            toks = secs = fwd = 0
            accept, chosen = [], []
            for i, p in enumerate(prompts):
                res = tb.speculator.generate(p, args.max_new_tokens, mode=mode,
                                             budget=budget or 1, sampling=sampling, seed=i)
                toks += len(res.tokens)
                secs += res.seconds
                fwd += res.target_forwards + 1  # + the prefill pass that made the first token
                accept += res.accept_lens
                chosen += res.budgets
                sample.setdefault(label, res.tokens)
                bar.update(1)
            if not isinstance(budget, int):  # the auto row says what it chose on average
                label += f" (mean B {sum(chosen) / max(1, len(chosen)):.1f})"
            rows.append((label, sum(accept) / max(1, len(accept)), toks / max(secs, 1e-9),
                         toks / fwd))
    table = Table(title=f"testbed, {len(prompts)} prompts x {args.max_new_tokens} tokens, "
                        f"temperature {args.temperature}, CPU")
    for col in ("mode", "accept length (tokens / verify step)", "tokens/s", "tokens per target forward"):
        table.add_column(col, justify="right")
    for label, tau, tps, tpf in rows:
        table.add_row(label, f"{tau:.2f}", f"{tps:.1f}", f"{tpf:.2f}")
    console = Console()
    console.print(table)
    first = tb.prompts[0]
    console.print("[bold]prompt:[/bold]", first.get("prompt") or first["messages"][-1]["content"],
                  markup=True)
    console.print(f"[bold]DDTree output:[/bold] {tb.tokenizer.decode(sample[modes[2][0]])}")
    console.print("(The testbed target has 2.7 M parameters, trained only so that drafts are "
                  "accepted as often as with a real model: its text is not meant to make sense. "
                  "What matters is that DDTree's tokens are the target's own.)")
    same = sample[modes[2][0]] == sample[modes[0][0]]
    if args.temperature == 0:
        console.print(f"DDTree output identical to autoregressive greedy: {same}")
        if len(modes) > 3:
            auto_same = sample[modes[3][0]] == sample[modes[0][0]]
            console.print(f"DDTree auto output identical to autoregressive greedy: {auto_same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
