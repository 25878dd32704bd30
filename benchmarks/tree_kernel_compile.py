"""Compile time and registers of the fused tree kernel (kernels/tree_build.py) per budget,
compiled ahead of time for a GPU that is not here (Triton's bundled ptxas): what a DDTREE
server spends compiling it at startup, and whether it spills.  `--kernel-file` takes another
version of kernels/tree_build.py (e.g. `git show e84a2b4:src/ddtree_sglang/kernels/
tree_build.py > /tmp/old_tree_build.py`, the one that sorted all B^2 candidates per depth in an
unrolled loop) for comparison; it runs at 4 warps, as that version did.

    python benchmarks/tree_kernel_compile.py --budgets 16,32,64,128 \\
        --out benchmarks/results/tree_kernel_compile.md
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ddtree_sglang.cli import CliError, Parser, positive_int, positive_int_list, run


def load_kernel_module(path: Path | None):
    if path is None:
        from ddtree_sglang.kernels import tree_build
        return tree_build
    if not path.is_file():
        raise CliError(f"--kernel-file {path}: no such file")
    spec = importlib.util.spec_from_file_location("tree_build_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "_tree_kernel"):
        raise CliError(f"--kernel-file {path}: defines no _tree_kernel (not a tree_build.py)")
    return module


def main() -> None:
    import os
    import platform
    import tempfile

    # a cold compile, as on a fresh server: no hit in Triton's on-disk cache
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tree_kernel_compile_")
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    import triton

    from ddtree_sglang.kernels import tree_build
    from ddtree_sglang.kernels.aot import compile_for, ptxas_report

    p = Parser(prog="tree_kernel_compile", description=__doc__)
    p.add_argument("--budgets", type=positive_int_list, default=[16, 32, 64, 128])
    p.add_argument("--depth", type=positive_int, default=15)
    p.add_argument("--arch", type=int, choices=[90, 120], default=90)
    p.add_argument("--kernel-file", type=Path, help="another version of tree_build.py")
    p.add_argument("--out", type=Path, help="append the markdown rows here")
    args = p.parse_args()
    module = load_kernel_module(args.kernel_file)
    label = str(args.kernel_file or "kernels/tree_build.py (this checkout)")
    rows = []
    for budget in args.budgets:
        if not tree_build.supported(budget, args.depth):
            raise CliError(f"--budgets: {budget} is outside the kernel's 1..{tree_build.MAX_BUDGET}")
        const = tree_build.launch_constants(budget, budget, args.depth)  # compile_for drops
        # the constexprs an older kernel file does not take (e.g. the A/B switch)
        warps = tree_build.warps_for(const["CP"]) if args.kernel_file is None else 4
        compiled, seconds = compile_for(module._tree_kernel, tree_build.AOT_POINTERS, const,
                                        args.arch, warps)
        r = ptxas_report(compiled, args.arch)
        rows.append(f"| {label} | sm_{args.arch} | {budget} | {args.depth} | {warps} | "
                    f"{seconds:.1f} | {r['registers']} | {r['spill_stores']} / "
                    f"{r['spill_loads']} |")
        print(rows[-1], flush=True)
    if args.out:
        header = ("| kernel | arch | B | depth | warps | compile s | registers | spill bytes "
                  "st / ld |\n|---|---|---|---|---|---|---|---|\n")
        text = args.out.read_text() if args.out.exists() else (
            f"# Fused tree kernel: ahead-of-time compile time and registers\n\nTriton "
            f"{triton.__version__}, on {platform.processor() or platform.machine()} "
            f"(this project's CPU machine, 2 cores: compile time is a CPU figure)\n\n{header}")
        args.out.write_text(text + "\n".join(rows) + "\n")


if __name__ == "__main__":
    raise SystemExit(run(main, "tree_kernel_compile"))
