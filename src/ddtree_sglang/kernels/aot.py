"""Ahead-of-time compilation of a Triton kernel for a GPU that is not here (Triton's bundled
ptxas), and ptxas's register / spill report: how the tests check that the kernels lower for
sm_90 and sm_120, and how benchmarks/*_registers.py read their register pressure on a CPU."""

from __future__ import annotations

import re
import subprocess
import tempfile
import time


def signature(kernel, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Triton AOT signature: the named pointer types, the constexprs, fp32 `sm_scale`, and i32
    for every other (scalar) argument."""
    return {name: "constexpr" if name in constexprs else pointers.get(
        name, "fp32" if name == "sm_scale" else "i32") for name in kernel.arg_names}


def compile_for(kernel, pointers: dict[str, str], constexprs: dict, arch: int, num_warps: int):
    """The kernel compiled for compute capability `arch` (90, 120) and the seconds it took."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    started = time.perf_counter()
    compiled = triton.compile(ASTSource(kernel, signature(kernel, pointers, constexprs),
                                        constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps))
    return compiled, time.perf_counter() - started


def ptxas_report(compiled, arch: int) -> dict:
    """Registers and spill bytes per thread of a compiled kernel (ptxas -v on its PTX)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        out = subprocess.run([get_ptxas(arch).path, "-v", f"-arch=sm_{arch}a", ptx.name, "-o",
                              "/dev/null"], capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr

    def number(pattern: str) -> int:
        return int(re.search(pattern, text).group(1))

    return dict(registers=number(r"Used (\d+) registers"),
                spill_stores=number(r"(\d+) bytes spill stores"),
                spill_loads=number(r"(\d+) bytes spill loads"))
