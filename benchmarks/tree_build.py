"""Time DDTree's per-step tree work on the GPU: build + verify layout + acceptance.

For every (batch, budget) the three stages run inside one captured CUDA graph, replayed many
times; the median replay time is reported.  The reference's CPU heap (one request at a time,
after copying the top-k to the host, as in the paper's code) is timed beside it.  A benchmark,
not a test: run it on the GPU machine and commit the JSON / markdown it writes.

    python benchmarks/tree_build.py --out benchmarks/results/tree_build_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from ddtree_sglang.tree.acceptance import accept_tree
from ddtree_bench.gpu_timing import graph_replay_ms
from ddtree_sglang.cli import CliError, Parser, positive_int, positive_int_list, run
from ddtree_sglang.tree.verify_layout import build_verify_layout, full_mask
from ddtree_sglang.reference.heap import heap_tree
from ddtree_sglang.tree.builder import build_draft_tree


def triton_build(logits, budget):
    from ddtree_sglang.kernels.tree_build import build_draft_tree_triton, supported

    depth = logits.shape[1]
    return build_draft_tree_triton(logits, budget) if supported(budget, depth) else None


def time_graph(fn, iters: int) -> float:
    """Median microseconds of one replay of `fn` captured in a CUDA graph."""
    return graph_replay_ms(fn, iters) * 1000.0


def bench_case(batch: int, budget: int, depth: int, vocab: int, ctx: int, iters: int,
               heap_reps: int) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(batch * 7 + budget)
    logits = torch.randn(batch, depth, vocab, device=dev, generator=g) * 3
    roots = torch.randint(0, vocab, (batch,), device=dev, generator=g)
    seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.long)
    n = budget + 1
    target = torch.randint(0, vocab, (batch, n), device=dev, generator=g)

    def step():
        tree = build_draft_tree(logits, budget)
        lay = build_verify_layout(tree, roots, seq_lens, max_depth=depth)
        full_mask(lay.ancestors, seq_lens, batch * ctx)
        accept_tree(lay.draft_tokens.view(batch, n), lay.tree_parents, lay.tree_depths,
                    target, max_depth=depth)

    def build_only():
        build_draft_tree(logits, budget)

    gpu_us = time_graph(step, iters)
    build_us = time_graph(build_only, iters)
    kernel_us, kernel_equal = None, None
    if triton_build(logits, budget) is not None:
        # recorded, not raised: one differing case must not cost the rest of the call's timings
        ref, fused = build_draft_tree(logits, budget), triton_build(logits, budget)
        kernel_equal = bool(torch.equal(ref.tokens, fused.tokens)
                            and torch.equal(ref.parents, fused.parents))
        kernel_us = time_graph(lambda: triton_build(logits, budget), iters)
    lp = torch.log_softmax(logits.float(), -1)
    heap_times = []
    for _ in range(heap_reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in range(batch):
            heap_tree(lp[b], budget)
        heap_times.append((time.perf_counter() - t0) * 1e6)
    heap_us = statistics.median(heap_times)
    return dict(batch=batch, budget=budget, depth=depth, vocab=vocab, ctx=ctx,
                gpu_step_us=round(gpu_us, 1), gpu_build_us=round(build_us, 1),
                triton_build_us=None if kernel_us is None else round(kernel_us, 1),
                triton_equals_torch=kernel_equal,
                cpu_heap_build_us=round(heap_us, 1), heap_over_gpu=round(heap_us / gpu_us, 1))


def write(args, rows: list[dict]) -> str:
    """The JSON and markdown table (after every row: a call cut short keeps what it timed)."""
    meta = dict(date=str(date.today()), device=torch.cuda.get_device_name(),
                torch=torch.__version__, command="python benchmarks/tree_build.py " +
                " ".join(f"--{k.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, list) else v}"
                         for k, v in vars(args).items() if k != "out"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# Tree build + layout + acceptance, CUDA graph replay ({meta['device']}, {meta['date']})",
             "", f"`{meta['command']}`", "",
             "| batch | B | GPU step (us) | GPU build only (us) | Triton build (us) | "
             "Triton = PyTorch | CPU heap build (us) | heap / GPU step |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['budget']} | {r['gpu_step_us']} | {r['gpu_build_us']} | "
              f"{r['triton_build_us'] if r['triton_build_us'] is not None else '-'} | "
              f"{'-' if r['triton_equals_torch'] is None else r['triton_equals_torch']} | "
              f"{r['cpu_heap_build_us']} | {r['heap_over_gpu']}x |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main() -> None:
    ap = Parser(prog="tree_build", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=positive_int_list, default=[1, 8, 32, 64])
    ap.add_argument("--budgets", type=positive_int_list, default=[16, 32, 64, 128, 256, 512])
    ap.add_argument("--depth", type=positive_int, default=15, help="draft depth L = block_size - 1")
    ap.add_argument("--vocab", type=positive_int, default=151936, help="Qwen3 vocabulary by default")
    ap.add_argument("--ctx", type=positive_int, default=1024, help="committed length per request")
    ap.add_argument("--iters", type=positive_int, default=200)
    ap.add_argument("--heap-reps", type=positive_int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/tree_build.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise CliError("this benchmark times CUDA graph replays and needs a CUDA GPU; none is "
                       "visible on this machine")
    rows = []
    for batch in args.batches:
        for budget in args.budgets:
            row = bench_case(batch, budget, args.depth, args.vocab, args.ctx, args.iters,
                             args.heap_reps)
            rows.append(row)
            print(json.dumps(row), flush=True)
            write(args, rows)
    print(write(args, rows))


if __name__ == "__main__":
    raise SystemExit(run(main, "tree_build"))
