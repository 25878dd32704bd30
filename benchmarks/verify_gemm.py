"""How much of a wide tree's verify is the target's matrix multiplies, and where do they stop
being weight-bandwidth bound?

A DDTREE verify of budget B runs the target on B + 1 tokens per request; DFLASH runs 16.  The
attention and the tree stages are DDTREE's own (other benchmarks), but the dense layers cost
what cuBLAS makes of M = batch x (B + 1) rows.  This times exactly those layers at Qwen3-8B
shapes (fused QKV 6144x4096, O 4096x4096, fused gate/up 24576x4096, down 4096x12288, x 36
layers with distinct weights so no layer's weights sit in L2, plus the 151,936-row LM head)
through `torch.nn.functional.linear`, the bf16 path SGLang takes on an H200 (cuBLASLt), as a
CUDA graph replay.  M = 16 is DFLASH's batch-1 verify; every other row is reported against it.

    python benchmarks/verify_gemm.py --out verify_gemm.json
"""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

import torch

from ddtree_bench.gpu_timing import graph_replay_ms
from ddtree_sglang.cli import CliError, Parser, positive_int, positive_int_list, run

# (out_features, in_features) of one Qwen3-8B decoder layer's linears, as SGLang fuses them
LAYER = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
LM_HEAD = (151936, 4096)
# batch x verify width: DFLASH 16 at batch 1/8/64; DDTREE B = 15/31/32/63/64/127/128
DEFAULT_ROWS = [16, 32, 33, 64, 65, 128, 129, 256, 264, 512, 520, 1024, 1032, 2048, 2112]


def main() -> None:
    p = Parser(prog="verify_gemm", description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", type=positive_int_list, default=DEFAULT_ROWS,
                   help="M values: batch x tokens per request in one verify")
    p.add_argument("--layers", type=positive_int, default=36)
    p.add_argument("--iters", type=positive_int, default=30)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise CliError("this benchmark times cuBLAS on a CUDA GPU; none is visible here")
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    weights = [{k: torch.randn(s, device=dev, dtype=dt, generator=g) * 0.02
                for k, s in LAYER.items()} for _ in range(args.layers)]
    head = torch.randn(LM_HEAD, device=dev, dtype=dt, generator=g) * 0.02
    params = sum(o * i for o, i in LAYER.values()) * args.layers + LM_HEAD[0] * LM_HEAD[1]
    rows = []
    for m in args.rows:
        x = torch.randn(m, 4096, device=dev, dtype=dt, generator=g)
        h = torch.randn(m, 12288, device=dev, dtype=dt, generator=g)

        def layers(x=x, h=h):
            for w in weights:
                torch.nn.functional.linear(x, w["qkv"])
                torch.nn.functional.linear(x, w["o"])
                torch.nn.functional.linear(x, w["gate_up"])
                torch.nn.functional.linear(h, w["down"])
            torch.nn.functional.linear(x, head)

        ms = graph_replay_ms(layers, args.iters)
        rows.append(dict(rows=m, ms=round(ms, 3),
                         tflops=round(2 * params * m / ms / 1e9, 1),
                         weight_tb_per_s=round(2 * params / ms / 1e9, 2)))
        print(json.dumps(rows[-1]), flush=True)
    base = next((r["ms"] for r in rows if r["rows"] == 16), rows[0]["ms"])
    for r in rows:
        r["over_16_rows_ms"] = round(r["ms"] - base, 3)
    meta = dict(date=str(date.today()), device=torch.cuda.get_device_name(),
                torch=torch.__version__, layers=args.layers, params=params)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    print(f"\n{meta['device']}: Qwen3-8B dense layers x {args.layers} + LM head, "
          f"{params / 1e9:.2f} B parameters, CUDA graph replay")
    print(f"{'M rows':>7} {'ms':>8} {'+ms vs 16':>10} {'TFLOP/s':>8} {'weights TB/s':>12}")
    for r in rows:
        print(f"{r['rows']:>7} {r['ms']:8.3f} {r['over_16_rows_ms']:10.3f} {r['tflops']:8.1f} "
              f"{r['weight_tb_per_s']:12.2f}")


if __name__ == "__main__":
    raise SystemExit(run(main, "verify_gemm"))
