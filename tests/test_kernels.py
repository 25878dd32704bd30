"""Triton kernels against their PyTorch references (Triton interpreter, CPU).  Each check
script sets TRITON_INTERPRET before importing triton, so it runs in its own process."""
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("script, marker", [
    ("kernel_interpret_check.py", "KERNEL OK"),        # fused tree selection vs tree.py
    ("kv_move_interpret_check.py", "KV MOVE OK"),      # accepted-KV move vs its reference
    ("logsumexp_interpret_check.py", "LOGSUMEXP OK"),  # float32 logsumexp vs torch
    ("accept_interpret_check.py", "ACCEPT OK"),        # fused acceptance walk vs accept_stage
    ("topk_interpret_check.py", "TOPK OK"),            # chunked top-k + logsumexp vs torch
    # split tree-verify attention (SGLang's kernels) vs the single call and a float32 reference
    ("verify_attention_interpret_check.py", "VERIFY ATTENTION OK"),
    # two-launch tree-verify attention vs its float32 reference and SGLang's masked kernel
    ("tree_attention_interpret_check.py", "TREE ATTENTION OK"),
])
def test_kernel_matches_its_reference(script, marker):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name(script))], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert marker in proc.stdout


def test_kernel_refuses_unsupported_shapes():
    pytest.importorskip("triton")
    import torch

    from ddtree_sglang.kernels.tree_build import build_draft_tree_triton, supported

    assert supported(64, 15) and not supported(65, 15) and not supported(32, 17)
    with pytest.raises(ValueError, match="budget 1..64"):
        build_draft_tree_triton(torch.randn(1, 15, 1000), 128)
