"""Does the tree mask make SGLang's Triton verify attention slower than the chain's?

The 2026-12-03 profile showed DDTREE's verify attention (`_fwd_kernel`) 3.1 ms per step above
DFLASH's at batch 64 (Qwen3-8B shapes).  This times SGLang's own `extend_attention_fwd` — the
kernel both verifies call on Hopper — outside the server, with identical prefixes, for:

    chain-16  : 16 query tokens, causal, no mask           (DFLASH's verify)
    mask-16   : 16 query tokens, a chain written as a custom mask
    tree-16   : 16 query tokens, a random tree mask         (DDTREE, B = 15)
    tree-17   : 17 query tokens, a random tree mask         (DDTREE, B = 16)
    split-16/17: the tree verifies as DDTREE's split attention computes them
                (sglang_plugin/verify_attention.py: mask-free prefix + masked tree, merged)
    tree-33   : 33 query tokens, a random tree mask         (DDTREE, B = 32)
    kernel-16/17/33: the tree verifies by DDTREE's two-launch kernel (kernels/tree_attention.py:
                split-KV prefix + masked tree in one online softmax), its default tile
    kernel-<tile>-16/17/33: the same with fixed tiles (TILES below: 64 or 32 keys a step, 8
                warps, 128 query rows a program = fewer prefix reads for trees of 17-32 tokens)

and checks that mask-16 gives the same output as chain-16 (the mask is laid out the way the
backend reads it) and that the split and the kernel give the single masked call's output.
Each variant is timed as a CUDA graph replay of one call (as the server runs it: no Python or
launch overhead in the figure), x the layer count.  GPU only; needs SGLang's kernels (a Python
that imports SGLang 0.5.17; `source scripts/checkout_env.sh` for the checkout).

    python benchmarks/verify_attention.py --out verify_attention.json
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch

from ddtree_bench.gpu_timing import graph_replay_ms
from ddtree_sglang.cli import CliError, Parser, positive_int, positive_int_list, run


# kernel tiles timed beside the default one (kernel-16/17/33: kernels.tree_attention.default_tile,
# 32 keys a step, 128 query rows for 65-128 grouped rows from batch 8 on, else 64)
TILES = {"kernel-n64": dict(block_m=64, block_n=64),
         "kernel-n32": dict(block_m=64, block_n=32),
         "kernel-w8": dict(block_m=64, block_n=64, num_warps=8),
         "kernel-bm128": dict(block_m=128, block_n=64),
         "kernel-bm128-n32": dict(block_m=128, block_n=32)}


def time_ms(fwd, c: dict, iters: int) -> float:
    """Median time of one call, replayed from a CUDA graph (the server graphs its verifies)."""
    return graph_replay_ms(lambda: fwd(**c), iters, warm_replays=0)


def print_tables(rows: list[dict], layers: int) -> None:
    """One table per tree width: per-step ms of every variant, and the worst difference."""
    print(f"\nper-step ms (one call x {layers} layers); chain-16 = DFLASH's causal call")
    for width in (16, 17, 33):
        names = (["chain-16"] if width == 16 else []) + [f"{v}-{width}" for v in (
            "tree", "split", "kernel", *TILES)]
        print(f"\n{width} tree tokens\n{'batch':>5} {'prefix':>6} "
              + " ".join(f"{n:>19}" for n in names) + " | worst |diff| split / kernels")
        for r in rows:
            worst = {v: max(r[f"{n}-{width}_max_diff"] for n in ([v] if v == "split" else
                                                                  ["kernel", *TILES]))
                     for v in ("split", "kernel")}
            print(f"{r['batch']:>5} {r['prefix']:>6} " + " ".join(f"{r[n]:19.3f}" for n in names)
                  + f" | {worst['split']:.2g} / {worst['kernel']:.2g}")
    print("chain-16 equals mask-16 (mask layout check):",
          all(r["chain_equals_mask"] for r in rows))


def main() -> None:
    p = Parser(prog="verify_attention", description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batches", type=positive_int_list, default=[1, 8, 64])
    p.add_argument("--prefixes", type=positive_int_list, default=[512, 1024])
    p.add_argument("--iters", type=positive_int, default=100)
    p.add_argument("--layers", type=positive_int, default=36,
                   help="per-step figure = one call x layers (Qwen3-8B: 36)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise CliError("this benchmark times SGLang's CUDA attention kernel and needs a CUDA "
                       "GPU; none is visible on this machine")
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd as fwd
    from sglang.kernels.ops.attention.merge_state import merge_state_triton

    from ddtree_sglang.sglang_plugin.verify_attention import VARIANTS, verify_case

    wrapped = {name: make(fwd, merge_state_triton, inspect.signature(fwd), min_requests=1)
               for name, make in VARIANTS.items()}  # split, kernel
    # the kernel with other tiles (kernels/tree_attention.py: the default spills registers)
    for name, tile in TILES.items():
        wrapped[name] = VARIANTS["kernel"](fwd, merge_state_triton, inspect.signature(fwd),
                                           min_requests=1, tile=tile)

    dev = "cuda"
    chain = torch.tril(torch.ones(16, 16, dtype=torch.bool))
    rows = []
    for bs in args.batches:
        for prefix in args.prefixes:
            shape = (bs, 16, prefix, 32, 8, 128, dev, torch.bfloat16)  # Qwen3-8B heads
            cases = {"chain-16": verify_case(*shape, ancestors=None)[0],
                     "mask-16": verify_case(*shape, ancestors=chain)[0],
                     "tree-16": verify_case(*shape, seed=1)[0],
                     "tree-17": verify_case(bs, 17, *shape[2:], seed=2)[0],
                     "tree-33": verify_case(bs, 33, *shape[2:], seed=3)[0]}
            fwd(**cases["chain-16"])
            fwd(**cases["mask-16"])
            same = torch.allclose(cases["chain-16"]["o_extend"].float(),
                                  cases["mask-16"]["o_extend"].float(), atol=2e-2, rtol=0)
            row = {"batch": bs, "prefix": prefix, "chain_equals_mask": bool(same)}
            for name, c in cases.items():
                row[name] = time_ms(fwd, c, args.iters) * args.layers
            for name in ("tree-16", "tree-17", "tree-33"):
                c = cases[name]
                for variant, call in wrapped.items():
                    fwd(**c)
                    single = c["o_extend"].float().clone()
                    # kernel-bm128-17 etc.: the width goes last
                    key = f"{variant}{name[4:]}"
                    row[key] = time_ms(call, c, args.iters) * args.layers
                    diff = (c["o_extend"].float() - single).abs().max()
                    row[f"{key}_max_diff"] = float(diff)
            rows.append(row)
            print(f"batch {bs} prefix {prefix}: timed", flush=True)
            # after every row: a call cut short by its time limit still returns what it timed
            args.out.write_text(json.dumps({"layers": args.layers, "rows": rows}, indent=1)
                                + "\n")
    print_tables(rows, args.layers)


if __name__ == "__main__":
    raise SystemExit(run(main, "verify_attention"))
