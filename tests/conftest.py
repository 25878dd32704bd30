import importlib.util
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ddtree_sglang.reference.heap import heap_tree as reference_heap_tree


def heap_tree(log_probs: torch.Tensor, budget: int):
    """(score, tokens-tuple) of the paper's heap, in pop order (reference/heap.py)."""
    return [(n.score, n.tokens) for n in reference_heap_tree(log_probs, budget)]


def node_prefixes(tokens, parents):
    """Token tuple of every node of one tree (tokens/parents as lists)."""
    pref = []
    for t, p in zip(tokens, parents):
        pref.append((pref[p] if p >= 0 else ()) + (t,))
    return pref


def near(a: float, b: float, tol: float = 1e-4) -> bool:
    return math.isclose(a, b, abs_tol=tol)


def server_args(**fields):
    """A stand-in for SGLang's ServerArgs: every field DDTREE reads, None unless given."""
    from types import SimpleNamespace

    from ddtree_sglang.sglang_plugin.server_args import READ_FIELDS

    return SimpleNamespace(**{**dict.fromkeys(READ_FIELDS), **fields})


ROOT = Path(__file__).resolve().parents[1]
HYBRID = ROOT / "testbed_hybrid"


@pytest.fixture(scope="session")
def make_hybrid() -> ModuleType:
    """scripts/make_hybrid_testbed.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("make_hybrid_testbed",
                                                  ROOT / "scripts" / "make_hybrid_testbed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def hybrid_testbed(make_hybrid, tmp_path_factory) -> Path:
    """testbed_hybrid/ as the script's --restore writes it from the tracked made_with.json,
    built once a session in a temporary folder (its weights are not tracked): every session
    checks that the script still writes the recorded bytes, as the GPU runs require."""
    out = tmp_path_factory.mktemp("testbed_hybrid")
    shutil.copy(HYBRID / "made_with.json", out)
    make_hybrid.restore(out, ROOT / "testbed")
    return out


def refused_launch_command() -> tuple[list[str], dict]:
    """`python -m sglang.launch_server` as a user runs it, with three things DDTREE refuses (a
    page size, an attention backend, a grammar setting); on this CPU machine --device cuda
    reaches DDTREE's validation."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SGLANG_DDTREE_") and k != "SGLANG_PLUGINS"}
    env.update(CUDA_VISIBLE_DEVICES="", SGLANG_DDTREE_GRAMMAR="fast",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path",
           str(ROOT / "testbed" / "target"), "--speculative-algorithm", "DDTREE",
           "--speculative-draft-model-path", str(ROOT / "testbed" / "drafter"),
           "--page-size", "8", "--device", "cuda", "--attention-backend", "fa3"]
    return cmd, env


@pytest.fixture(scope="session", autouse=True)
def background_launches():
    """SGLang launches whose end a test reads, started with the session so that they run
    beside the in-process tests (importing SGLang alone takes ~10 s); killed at its end."""
    procs = {}
    if importlib.util.find_spec("sglang") is not None:
        cmd, env = refused_launch_command()
        procs["refused"] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
