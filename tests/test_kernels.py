"""Triton kernels against their PyTorch references (Triton interpreter, CPU)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_tree_kernel_matches_pytorch_builder():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    script = Path(__file__).with_name("kernel_interpret_check.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "KERNEL OK" in proc.stdout


def test_kernel_refuses_unsupported_shapes():
    pytest.importorskip("triton")
    import torch

    from ddtree_sglang.kernels.tree_build import build_draft_tree_triton, supported

    assert supported(64, 15) and not supported(65, 15) and not supported(32, 17)
    with pytest.raises(ValueError, match="budget 1..64"):
        build_draft_tree_triton(torch.randn(1, 15, 1000), 128)


def test_kv_move_kernel_matches_reference():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    script = Path(__file__).with_name("kv_move_interpret_check.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "KV MOVE OK" in proc.stdout


def test_logsumexp_kernel_matches_reference():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    script = Path(__file__).with_name("logsumexp_interpret_check.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "LOGSUMEXP OK" in proc.stdout
