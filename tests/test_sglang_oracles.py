"""Our layout and acceptance carry the same meaning as SGLang 0.5.17's EAGLE tree kernels."""
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_layout_and_greedy_verify_match_sglang_kernels():
    pytest.importorskip("sglang")
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    script = Path(__file__).with_name("sglang_oracle_check.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ORACLE OK" in proc.stdout
