"""Registers and spills of the tree-attention kernel per tile, from ptxas -v on the PTX Triton
compiles ahead of time (no GPU needed: Triton's bundled ptxas).  Why: the default tile uses all
255 registers on sm_90 and spills; this says which tiles do not, for the GPUs we serve on, so
that benchmarks/verify_attention.py's timings can be read against it.

    python benchmarks/tree_attention_registers.py --out benchmarks/results/tree_attention_registers.md
"""

from __future__ import annotations

from pathlib import Path

from ddtree_sglang.cli import Parser, positive_int_list, run

# (block_m, block_n, num_warps): the kernel's default and the tiles verify_attention.py times
TILES = [(64, 64, 4), (64, 32, 4), (64, 64, 8), (128, 64, 8), (128, 32, 8)]


def main() -> None:
    from ddtree_sglang.kernels import tree_attention as ta
    from ddtree_sglang.kernels.aot import compile_for, ptxas_report

    p = Parser(prog="tree_attention_registers", description=__doc__)
    p.add_argument("--out", type=Path, help="write the markdown table here")
    p.add_argument("--archs", type=positive_int_list, default=[90, 120],
                   help="compute capabilities (90: H200, 120: RTX Pro 6000)")
    args = p.parse_args()
    if set(args.archs) - {90, 120}:
        p.error(f"--archs: accepted 90 (H200) and 120 (RTX Pro 6000); got {args.archs}")
    launches = [("fused (one split)", ta._prefix_kernel, 1), ("prefix (8 splits)",
                ta._prefix_kernel, 8), ("tree + merge (8 splits)", ta._tree_merge_kernel, 8)]
    lines = ["# Tree-attention kernel: registers / spill bytes per thread (ptxas -v, bf16, "
             "4 grouped heads, head dim 128)", "",
             "| arch | block_m | block_n | warps | " + " | ".join(n for n, _, _ in launches)
             + " |", "|---" * (4 + len(launches)) + "|"]
    for arch in args.archs:
        for block_m, block_n, warps in TILES:
            cells = []
            for _, kernel, splits in launches:
                const = dict(GROUP=4, SPLITS=splits, HEAD_DIM=128, BLOCK_D=128, BM=block_m,
                             BN=block_n)
                r = ptxas_report(compile_for(kernel, ta.AOT_POINTERS, const, arch, warps)[0],
                                 arch)
                cells.append(f"{r['registers']} / {r['spill_stores']} st, {r['spill_loads']} ld")
            lines.append(f"| sm_{arch} | {block_m} | {block_n} | {warps} | "
                         + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(run(main, "tree_attention_registers"))
