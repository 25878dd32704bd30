"""Triton kernels against their PyTorch references (Triton interpreter, CPU).  Each check
script sets TRITON_INTERPRET before importing triton, so it runs in its own process."""
import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest


CHECKS = [
    ("kernel_interpret_check.py", "KERNEL OK"),        # fused tree selection vs draft_tree_builder.py
    ("kv_move_interpret_check.py", "KV MOVE OK"),      # accepted-KV move vs its reference
    ("logsumexp_interpret_check.py", "LOGSUMEXP OK"),  # float32 logsumexp vs torch
    ("accept_interpret_check.py", "ACCEPT OK"),        # fused acceptance walk vs accept_stage
    ("topk_interpret_check.py", "TOPK OK"),            # chunked top-k + logsumexp vs torch
    # split tree-verify attention (SGLang's kernels) vs the single call and a float32 reference
    ("verify_attention_interpret_check.py", "VERIFY ATTENTION OK"),
    # two-launch tree-verify attention vs its float32 reference and SGLang's masked kernel
    ("tree_attention_interpret_check.py", "TREE ATTENTION OK"),
    # the verify layout and greedy acceptance vs SGLang's own EAGLE kernels (needs SGLang)
    ("sglang_oracle_check.py", "ORACLE OK"),
]


@pytest.fixture(scope="module")
def interpreted():
    """Every check script started at once, two at a time (each is one single-threaded
    interpreter process: the CI machine's two cores run them side by side)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")

    def run(script):
        return subprocess.run([sys.executable, str(Path(__file__).with_name(script))], env=env,
                              capture_output=True, text=True, timeout=900)

    needs_sglang = {"sglang_oracle_check.py"}
    have_sglang = importlib.util.find_spec("sglang") is not None
    with ThreadPoolExecutor(2) as pool:
        yield {script: pool.submit(run, script) for script, _ in CHECKS
               if have_sglang or script not in needs_sglang}


@pytest.mark.parametrize("script, marker", CHECKS)
def test_kernel_matches_its_reference(script, marker, interpreted):
    if script not in interpreted:
        pytest.skip("the oracle is SGLang's kernels: SGLang is not installed")
    proc = interpreted[script].result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert marker in proc.stdout


def test_kernel_refuses_unsupported_shapes():
    pytest.importorskip("triton")
    import torch

    from ddtree_sglang.kernels.tree_build import build_draft_tree_triton, supported

    assert supported(256, 15) and not supported(257, 15) and not supported(32, 17)
    with pytest.raises(ValueError, match="budget 1..256"):
        build_draft_tree_triton(torch.randn(1, 15, 1000), 300)


def test_tree_kernel_first_candidate_pass_fits_and_covers_the_beam():
    """The kernel's first pass keeps, per beam entry of score rank r, its best min(K, B // (r+1))
    tokens: for every B <= 256, K <= B and beam width w <= B that is at least the new beam's
    width min(B, w K) (so its threshold exists) and at most the scratch capacity."""
    pytest.importorskip("triton")
    import torch

    from ddtree_sglang.kernels.tree_build import MAX_BUDGET, candidate_capacity

    for budget in range(1, MAX_BUDGET + 1):
        ranks = torch.arange(budget)
        ks = torch.arange(1, budget + 1)[:, None]                     # [K, 1]
        per_rank = torch.minimum(ks, budget // (ranks + 1)[None, :])   # [K, r]
        first_pass = per_rank.cumsum(1)                                # [K, w]: beam width w = r + 1
        widths = torch.minimum(torch.full_like(first_pass, budget), (ranks + 1)[None, :] * ks)
        assert bool((first_pass >= widths).all()), budget
        capacity = torch.tensor([candidate_capacity(budget, int(k)) for k in ks.flatten()])
        assert bool((first_pass[:, -1] <= capacity).all()), budget


@pytest.mark.parametrize("arch", [90, 120])  # H200 (Hopper) and RTX Pro 6000 (Blackwell)
def test_tree_attention_compiles_for_the_gpus_we_serve_on(arch):
    """Ahead-of-time compilation to a cubin (Triton's bundled ptxas, no GPU needed): the
    kernels the interpreter checks also lower for real targets, in bf16 at Qwen3 shapes."""
    pytest.importorskip("triton")
    from ddtree_sglang.kernels import tree_attention as ta
    from ddtree_sglang.kernels.aot import compile_for

    for block_m, warps in ta.WARPS.items():
        for kernel, splits in [(ta._prefix_kernel, 1), (ta._prefix_kernel, 8),
                               (ta._tree_merge_kernel, 8)]:
            # 32-key steps are the default tile (ta.default_tile), 64 stays selectable
            block_n = ta.BLOCK_NS[0] if kernel is ta._tree_merge_kernel else ta.BLOCK_NS[splits > 1]
            const = dict(GROUP=4, SPLITS=splits, HEAD_DIM=128, BLOCK_D=128, BM=block_m,
                         BN=block_n)
            compiled, _ = compile_for(kernel, ta.AOT_POINTERS, const, arch, warps)
            assert compiled.asm["cubin"], (kernel.__name__, splits, block_m, block_n)


def test_tree_attention_default_tile_follows_the_h200_measurements():
    """32 keys a step always; one 128-row block for a tree of 65-128 grouped rows from batch 8
    on (read the prefix once), 64-row blocks at batch 1 or for other tree sizes."""
    pytest.importorskip("triton", reason="the kernels are Triton's")
    from ddtree_sglang.kernels.tree_attention import BLOCK_NS, WARPS, default_tile

    assert default_tile(1, 64) == (64, 32) and default_tile(64, 64) == (64, 32)
    assert default_tile(1, 68) == (64, 32)                        # batch 1: more programs
    assert default_tile(8, 68) == (128, 32) and default_tile(64, 128) == (128, 32)
    assert default_tile(8, 132) == (64, 32)                       # 33 tokens: 64-row blocks
    for bs in (1, 8, 64):
        for rows in (4, 64, 68, 128, 132, 516):
            m, n = default_tile(bs, rows)
            assert m in WARPS and n in BLOCK_NS


def test_tree_attention_splits_the_prefix_for_two_waves_of_the_gpus_sms():
    """Short batches split each prefix across programs until about two waves of the GPU's SMs
    are busy (H200: 132, RTX Pro 6000: 188); a full batch is not split (the fused launch)."""
    pytest.importorskip("triton", reason="the kernels are Triton's")
    from ddtree_sglang.kernels.tree_attention import prefix_splits

    assert prefix_splits(1, 8, 1) == 32           # 264 // 8 = 33, capped at 32
    assert prefix_splits(8, 8, 1) == 4            # 264 // 64
    assert prefix_splits(8, 8, 1, sms=188) == 5   # 376 // 64
    assert prefix_splits(8, 8, 3) == 1 and prefix_splits(64, 8, 1) == 1


@pytest.mark.parametrize("arch", [90, 120])
def test_tree_kernel_compiles_for_the_gpus_we_serve_on(arch):
    """The fused tree kernel lowers to a cubin for Hopper and Blackwell (Triton's bundled
    ptxas, no GPU) at depth 15 with the capacities and warps it launches with."""
    pytest.importorskip("triton")
    from ddtree_sglang.kernels import tree_build as tb
    from ddtree_sglang.kernels.aot import compile_for

    for budget in (16, 64):
        const = tb.launch_constants(budget, budget, depth=15)
        compiled, _ = compile_for(tb._tree_kernel, tb.AOT_POINTERS, const, arch,
                                  tb.warps_for(const["CP"]))
        assert compiled.asm["cubin"], budget
