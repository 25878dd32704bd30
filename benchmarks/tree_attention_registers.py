"""Registers and spills of the tree-attention kernel per tile, from ptxas -v on the PTX Triton
compiles ahead of time (no GPU needed: Triton's bundled ptxas).  Why: the default tile uses all
255 registers on sm_90 and spills; this says which tiles do not, for the GPUs we serve on, so
that benchmarks/verify_attention.py's timings can be read against it.

    python benchmarks/tree_attention_registers.py --out benchmarks/results/tree_attention_registers.md
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from ddtree_sglang.cli import Parser, run

# (block_m, block_n, num_warps): the kernel's default and the tiles verify_attention.py times
TILES = [(64, 64, 4), (64, 32, 4), (64, 64, 8), (128, 64, 8), (128, 32, 8)]


def signature(kernel, constexprs: dict) -> dict[str, str]:
    """Triton AOT signature at Qwen3 shapes: bf16 tensors, int64 indices, bool mask."""
    pointers = {**{n: "*bf16" for n in ("Q", "K_buf", "V_buf", "K_ext", "V_ext", "O")},
                **{n: "*i64" for n in ("qo_indptr", "kv_indptr", "mask_indptr", "kv_indices")},
                "Mask": "*i1", "O_part": "*fp32", "L_part": "*fp32"}
    return {name: "constexpr" if name in constexprs else pointers.get(
        name, "fp32" if name == "sm_scale" else "i32") for name in kernel.arg_names}


def ptxas_report(arch: int, tile: tuple[int, int, int], kernel, splits: int) -> dict:
    """Registers and spill bytes of one compiled kernel (ptxas -v)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    block_m, block_n, warps = tile
    const = dict(GROUP=4, SPLITS=splits, HEAD_DIM=128, BLOCK_D=128, BM=block_m, BN=block_n)
    compiled = triton.compile(ASTSource(kernel, signature(kernel, const), constexprs=const),
                              target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        out = subprocess.run([get_ptxas(arch).path, "-v", f"-arch=sm_{arch}a", ptx.name, "-o",
                              "/dev/null"], capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    number = lambda pattern: int(re.search(pattern, text).group(1))  # noqa: E731
    return dict(registers=number(r"Used (\d+) registers"),
                spill_stores=number(r"(\d+) bytes spill stores"),
                spill_loads=number(r"(\d+) bytes spill loads"))


def main() -> None:
    from ddtree_sglang.kernels import tree_attention as ta

    p = Parser(prog="tree_attention_registers", description=__doc__)
    p.add_argument("--out", type=Path, help="write the markdown table here")
    p.add_argument("--archs", default="90,120", help="compute capabilities (90: H200, 120: "
                   "RTX Pro 6000)")
    args = p.parse_args()
    launches = [("fused (one split)", ta._prefix_kernel, 1), ("prefix (8 splits)",
                ta._prefix_kernel, 8), ("tree + merge (8 splits)", ta._tree_merge_kernel, 8)]
    lines = ["# Tree-attention kernel: registers / spill bytes per thread (ptxas -v, bf16, "
             "4 grouped heads, head dim 128)", "",
             "| arch | block_m | block_n | warps | " + " | ".join(n for n, _, _ in launches)
             + " |", "|---" * (4 + len(launches)) + "|"]
    for arch in (int(a) for a in args.archs.split(",")):
        for tile in TILES:
            cells = []
            for _, kernel, splits in launches:
                r = ptxas_report(arch, tile, kernel, splits)
                cells.append(f"{r['registers']} / {r['spill_stores']} st, {r['spill_loads']} ld")
            lines.append(f"| sm_{arch} | {tile[0]} | {tile[1]} | {tile[2]} | "
                         + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(run(main, "tree_attention_registers"))
