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

and checks that mask-16 gives the same output as chain-16 (the mask is laid out the way the
backend reads it) and that the split gives the single masked call's output.  GPU only; needs SGLang's kernels (source scripts/device_env.sh).

    python benchmarks/verify_attention.py --out verify_attention.json
"""

from __future__ import annotations

import inspect
import json
import statistics
from pathlib import Path

import torch

from ddtree_sglang.cli import CliError, Parser, positive_int, positive_int_list, run


def tree_ancestors(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, n] bool, row i = node i's ancestors and itself, for a random tree rooted at 0."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return anc


def make_case(bs: int, n: int, prefix: int, anc: torch.Tensor | None, dev: str) -> dict:
    """Inputs of one extend_attention_fwd call: bs requests of `prefix` cached tokens + n new."""
    heads, kv_heads, dim = 32, 8, 128
    gen = torch.Generator(device=dev).manual_seed(0)
    total = bs * prefix

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.bfloat16)

    mask = None
    if anc is not None:  # row-major [n, prefix + n] per request: the prefix is visible
        row = torch.cat([torch.ones(n, prefix, dtype=torch.bool), anc], dim=1)
        mask = row.reshape(-1).repeat(bs).to(dev)
    return dict(
        q=rnd(bs * n, heads, dim), k=rnd(bs * n, kv_heads, dim), v=rnd(bs * n, kv_heads, dim),
        o=torch.empty(bs * n, heads, dim, device=dev, dtype=torch.bfloat16),
        kb=rnd(total, kv_heads, dim), vb=rnd(total, kv_heads, dim),
        qo=torch.arange(bs + 1, device=dev, dtype=torch.int64) * n,
        kvp=torch.arange(bs + 1, device=dev, dtype=torch.int32) * prefix,
        kvi=torch.randperm(total, device=dev, generator=gen).to(torch.int64),
        mask=mask,
        mip=torch.arange(bs + 1, device=dev, dtype=torch.int64) * n * (prefix + n),
        n=n)


def call(fwd, c: dict) -> None:
    """One attention call of case c with SGLang's positional convention (as the backend)."""
    fwd(c["q"], c["k"], c["v"], c["o"], c["kb"], c["vb"], c["qo"], c["kvp"], c["kvi"],
        c["mask"], True, c["mip"] if c["mask"] is not None else None, c["n"], 1.0, 1.0,
        sm_scale=128 ** -0.5)


def time_ms(fwd, c: dict, iters: int) -> float:
    for _ in range(5):
        call(fwd, c)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(fwd, c)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


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

    from ddtree_sglang.sglang_plugin.verify_attention import split_attention

    split = split_attention(fwd, merge_state_triton, inspect.signature(fwd))

    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    chain = torch.tril(torch.ones(16, 16, dtype=torch.bool))
    rows = []
    for bs in args.batches:
        for prefix in args.prefixes:
            cases = {"chain-16": make_case(bs, 16, prefix, None, dev),
                     "mask-16": make_case(bs, 16, prefix, chain, dev),
                     "tree-16": make_case(bs, 16, prefix, tree_ancestors(16, gen), dev),
                     "tree-17": make_case(bs, 17, prefix, tree_ancestors(17, gen), dev)}
            call(fwd, cases["chain-16"])
            call(fwd, cases["mask-16"])
            same = torch.allclose(cases["chain-16"]["o"].float(),
                                  cases["mask-16"]["o"].float(), atol=2e-2, rtol=0)
            row = {"batch": bs, "prefix": prefix, "chain_equals_mask": bool(same)}
            for name, c in cases.items():
                row[name] = time_ms(fwd, c, args.iters) * args.layers
            for name in ("tree-16", "tree-17"):
                c = cases[name]
                call(fwd, c)
                single = c["o"].float().clone()
                row["split" + name[4:]] = time_ms(split, c, args.iters) * args.layers
                row[f"split{name[4:]}_max_diff"] = float((c["o"].float() - single).abs().max())
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps({"layers": args.layers, "rows": rows}, indent=1) + "\n")
    names = ["chain-16", "mask-16", "tree-16", "tree-17", "split-16", "split-17"]
    print(f"\nper-step ms (one call x {args.layers} layers)")
    print(f"{'batch':>5} {'prefix':>6} " + " ".join(f"{n:>9}" for n in names)
          + " | mask ok, split max diff")
    for r in rows:
        print(f"{r['batch']:>5} {r['prefix']:>6} " + " ".join(f"{r[n]:9.3f}" for n in names)
              + f" | {r['chain_equals_mask']}, {r['split-17_max_diff']:.2g}")


if __name__ == "__main__":
    raise SystemExit(run(main, "verify_attention"))
