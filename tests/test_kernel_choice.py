"""kernel_choice: every kernel checked once against its reference, one frozen set of choices.

The Triton kernels themselves run in tests/test_kernels.py (interpreter); here they are
replaced by wrong or broken stand-ins to check that each check catches them, and the choice
is made with stand-in checks (no GPU needed)."""
import pytest
import torch

from ddtree_sglang.kernels import choice as kernel_choice
from ddtree_sglang.tree.stages import accept_stage
from ddtree_sglang.tree.draft_tree import torch_top_log_probs
from ddtree_sglang.kernels.choice import (Kernels, check_accept_kernel, check_builder,
                                         choose_kernels, random_verified_trees)
from ddtree_sglang.tree.builder import build_draft_tree


def test_the_default_set_is_the_pytorch_references():
    k = Kernels()
    logits = torch.randn(2, 4, 30)
    assert all(torch.equal(a, b) for a, b in zip(k.top_log_probs(logits, 5),
                                                 torch_top_log_probs(logits, 5)))
    assert torch.equal(k.build_tree(logits, 9).tokens, build_draft_tree(logits, 9).tokens)
    assert k.accept_stage is accept_stage
    assert "tree builder torch" in k.describe() and "not used" not in k.describe()
    # no GPU: nothing to check, the references serve
    assert choose_kernels(tree_kernel="auto", budget=16, depth=15, vocab=100, out_width=16,
                          device="cpu", dtype=torch.float32) == Kernels()


def test_a_wrong_or_broken_tree_kernel_is_caught(monkeypatch):
    pytest.importorskip("triton", reason="the kernels are Triton's")
    from ddtree_sglang.kernels import tree_build

    def wrong(logits, budget, top=torch_top_log_probs):  # every token off by one
        tree = build_draft_tree(logits, budget, top)
        return type(tree)(tree.tokens + 1, tree.parents, tree.depths, tree.scores)

    def broken(logits, budget, top=torch_top_log_probs):
        raise RuntimeError("no kernel for this GPU")

    fused = Kernels(tree_builder="triton")
    monkeypatch.setattr(tree_build, "build_draft_tree_triton", wrong)
    assert "disagrees" in check_builder(fused, Kernels(), 8, 4, 50, "cpu", torch.float32)
    monkeypatch.setattr(tree_build, "build_draft_tree_triton", broken)
    assert "RuntimeError: no kernel" in check_builder(fused, Kernels(), 8, 4, 50, "cpu",
                                                      torch.float32)
    assert check_builder(Kernels(), Kernels(), 16, 15, 100, "cpu", torch.float32) is None


def test_a_failing_logsumexp_or_top_k_kernel_is_caught(monkeypatch):
    pytest.importorskip("triton", reason="the kernels are Triton's")
    from ddtree_sglang.kernels import logsumexp, topk

    def broken(x, block=2048):
        raise RuntimeError("PTX not supported")

    def wrong(x, k, chunk=4096):
        lp, ids = topk.top_log_probs_reference(x, k)
        return lp, ids.flip(-1)  # right values, wrong ids

    monkeypatch.setattr(logsumexp, "logsumexp_triton", broken)
    why = kernel_choice._check(lambda: kernel_choice._logsumexp_agrees(100, "cpu", torch.float32))
    assert "RuntimeError: PTX" in why
    monkeypatch.setattr(topk, "top_log_probs_triton", wrong)
    why = kernel_choice._check(lambda: kernel_choice._topk_agrees(100, 8, "cpu", torch.float32))
    assert "disagrees" in why
    assert kernel_choice._topk_agrees(100, 65, "cpu", torch.float32)  # not used above 64


def test_random_verified_trees_and_a_failing_accept_kernel(monkeypatch):
    pytest.importorskip("triton", reason="the kernels are Triton's")
    from ddtree_sglang.kernels import accept

    tokens, parents, depths, choice = random_verified_trees(3, 20, 4, 3, torch.Generator(), "cpu")
    assert (parents[:, 0] == -1).all() and (parents[:, 1:] < torch.arange(1, 20)).all()
    assert depths.max() <= 4
    for r in range(3):  # siblings carry distinct tokens, so at most one child can match
        for p in range(20):
            kids = tokens[r][parents[r] == p]
            assert len(set(kids.tolist())) == len(kids)
    commit_lens = accept_stage(tokens, parents, depths, choice, 4, 5)[0]
    assert (commit_lens >= 1).all() and (commit_lens > 1).any()  # the target follows the tree

    def wrong(*args):
        out = list(accept_stage(*args))
        out[0] = out[0] + 1
        return tuple(out)

    def broken(*args):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(accept, "accept_stage_triton", wrong)
    assert "disagrees" in check_accept_kernel("cpu")
    monkeypatch.setattr(accept, "accept_stage_triton", broken)
    assert "RuntimeError: no kernel" in check_accept_kernel("cpu")


@pytest.fixture
def checks(monkeypatch):
    """Stand-in checks with a GPU 'present': the verdicts are the test's to set."""
    verdicts = dict(topk=True, lse=True, builder=None, accept=None, kv_move=None)
    monkeypatch.setattr(kernel_choice.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel_choice, "_topk_agrees", lambda *a: verdicts["topk"])
    monkeypatch.setattr(kernel_choice, "_logsumexp_agrees", lambda *a: verdicts["lse"])
    monkeypatch.setattr(kernel_choice, "check_builder", lambda *a: verdicts["builder"])
    monkeypatch.setattr(kernel_choice, "check_accept_kernel", lambda *a: verdicts["accept"])
    monkeypatch.setattr(kernel_choice, "check_kv_move_kernel", lambda *a: verdicts["kv_move"])
    return verdicts


def choose(**kw):
    args = dict(tree_kernel="auto", budget=64, depth=15, vocab=1000, out_width=16,
                device="cuda", dtype=torch.bfloat16)
    return choose_kernels(**{**args, **kw})


def test_every_kernel_that_passes_is_used(checks):
    k = choose(verify_attention="kernel", check_verify_attention=lambda v: None)
    assert k == Kernels(tree_builder="triton", accept="triton", topk=True, logsumexp=True,
                        kv_move=True, verify_attention="kernel")


def test_each_failing_kernel_falls_back_with_its_reason(checks):
    checks.update(lse=False, builder="it built another tree", kv_move="RuntimeError: x")
    k = choose(verify_attention="kernel", check_verify_attention=lambda v: f"{v} differs")
    assert (k.tree_builder, k.accept, k.topk, k.logsumexp, k.kv_move, k.verify_attention) == \
        ("torch", "triton", True, False, False, "single")
    assert dict(k.dropped) == {"Triton logsumexp": "it disagrees with its PyTorch reference",
                               "fused tree kernel": "it built another tree",
                               "Triton KV move": "RuntimeError: x",
                               "kernel verify attention": "kernel differs"}
    assert "fused tree kernel not used: it built another tree" in k.describe()


def test_the_fused_builder_only_where_it_fits_or_when_not_asked(checks):
    assert choose(budget=256).tree_builder == "triton"
    assert choose(budget=512).tree_builder == "torch"   # beyond the kernel: exact fallback
    assert choose(depth=20).tree_builder == "torch"
    assert choose(tree_kernel="torch").tree_builder == "torch"
    assert choose(tree_kernel="auto", budget=64).tree_builder == "triton"
