import torch

from ddtree_sglang.decode_step import StepCommit, accept_stage, tree_stage
from ddtree_sglang.layout import VerifyLayout, build_verify_layout
from ddtree_sglang.tree import build_draft_tree


def test_tree_stage_is_build_plus_layout():
    logits = torch.randn(3, 15, 50)
    roots, seq = torch.tensor([1, 2, 3]), torch.tensor([4, 9, 0])
    lay = VerifyLayout(*tree_stage(logits, roots, seq, 20, 15))
    ref = build_verify_layout(build_draft_tree(logits, 20), roots, seq, max_depth=15)
    assert torch.equal(lay.draft_tokens, ref.draft_tokens)
    assert torch.equal(lay.ancestors, ref.ancestors) and torch.equal(lay.positions, ref.positions)


def test_accept_stage_commit_format():
    # two requests, N = 6: root 0 -> {1, 2}; 1 -> {3, 4}; 3 -> {5}
    tokens = torch.tensor([[99, 10, 11, 12, 13, 14]] * 2)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3]] * 2)
    depths = torch.tensor([[0, 1, 1, 2, 2, 3]] * 2)
    choice = torch.tensor([[10, 12, 0, 14, 0, 8],    # whole path 0-1-3-5, bonus 8
                           [11, 0, 5, 0, 0, 0]])     # 0-2, bonus 5
    step = StepCommit(*accept_stage(tokens, parents, depths, choice, depth=3, out_width=4))
    assert step.commit_lens.tolist() == [4, 2] and step.commit_lens.dtype == torch.int32
    # rows in the flattened [bs * N] verify block, -1 past the end (EAGLE's accept_index)
    assert step.accept_index.tolist() == [[0, 1, 3, 5], [6, 8, -1, -1]]
    assert step.accept_index.dtype == torch.int32
    assert step.feature_rows.tolist() == [[0, 1, 3, 5], [6, 8, 6, 6]]
    assert step.bonus.tolist() == [8, 5]
    assert step.tokens.tolist() == [[10, 12, 14, 8], [11, 5, 0, 0]]


def test_kv_moves_put_the_accepted_path_at_its_positions():
    """Slot contents are node ids; after the moves, position j of each request holds the j-th
    node of its accepted path (root first), whatever order the moves read and write in."""
    from ddtree_sglang.decode_step import kv_moves
    from ddtree_sglang.kernels.kv_move import move_rows_reference

    tokens = torch.tensor([[99, 10, 11, 12, 13, 14]] * 3)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3]] * 3)
    depths = torch.tensor([[0, 1, 1, 2, 2, 3]] * 3)
    choice = torch.tensor([[10, 12, 0, 14, 0, 8],   # path 0-1-3-5: slot 3 -> 2 and 5 -> 3
                           [11, 0, 5, 0, 0, 0],     # path 0-2: slot 2 -> 1
                           [7, 0, 0, 0, 0, 0]])     # root only
    step = StepCommit(*accept_stage(tokens, parents, depths, choice, depth=3, out_width=4))
    n = 6
    out_cache_loc = torch.tensor([40, 41, 42, 43, 44, 45, 10, 11, 12, 13, 14, 15,
                                  30, 31, 32, 33, 34, 35])
    tgt, src = kv_moves(out_cache_loc, step.accept_index, step.commit_lens, n)
    assert tgt.tolist() == [[40, 41, 42, 43], [10, 11, 12, 13], [30, 31, 32, 33]]
    assert src.tolist() == [[40, 41, 43, 45], [10, 12, 12, 13], [30, 31, 32, 33]]
    kv = torch.zeros(50, 2, dtype=torch.long)
    kv[out_cache_loc, 0] = torch.arange(3 * n) % n  # node id held by each slot
    move_rows_reference([kv], tgt, src)
    assert kv[tgt[0], 0].tolist() == [0, 1, 3, 5]
    assert kv[tgt[1, :2], 0].tolist() == [0, 2] and kv[tgt[2, :1], 0].tolist() == [0]


def test_builder_choice_and_its_startup_check():
    from ddtree_sglang.decode_step import check_builder, select_builder
    from ddtree_sglang.kernels.tree_build import build_draft_tree_triton

    assert select_builder("torch", 16, 15)[1] == "torch"
    assert select_builder("auto", 32, 15) == (build_draft_tree_triton, "triton")
    assert select_builder("auto", 128, 15)[1] == "triton"   # faster at every budget timed
    assert select_builder("auto", 512, 15)[1] == "torch"    # beyond the kernel
    assert select_builder("triton", 64, 15)[1] == "triton"  # forced
    assert select_builder("triton", 256, 15)[1] == "triton"
    assert select_builder("triton", 512, 15)[1] == "torch"  # beyond the kernel: exact fallback
    assert check_builder(build_draft_tree, 16, 15, 100, "cpu", torch.float32) is None

    def wrong(logits, budget):  # a builder that drops the best node's token
        tree = build_draft_tree(logits, budget)
        return type(tree)(tree.tokens + 1, tree.parents, tree.depths, tree.scores)

    def broken(logits, budget):
        raise RuntimeError("no kernel for this GPU")

    assert "different tree" in check_builder(wrong, 8, 4, 50, "cpu", torch.float32)
    assert "RuntimeError: no kernel" in check_builder(broken, 8, 4, 50, "cpu", torch.float32)


def test_a_failing_logsumexp_kernel_is_switched_off(monkeypatch):
    from ddtree_sglang import tree
    from ddtree_sglang.kernels import logsumexp

    def broken(x, block=2048):
        raise RuntimeError("PTX not supported")

    monkeypatch.setattr(logsumexp, "logsumexp_triton", broken)
    monkeypatch.setitem(tree.LSE_KERNEL, "enabled", True)
    assert "RuntimeError: PTX" in tree.check_logsumexp_kernel(100, "cpu", torch.float32)
    assert tree.LSE_KERNEL["enabled"] is False


def test_random_verified_trees_and_a_failing_accept_kernel(monkeypatch):
    from ddtree_sglang.decode_step import (accept_stage, check_accept_kernel,
                                           random_verified_trees)
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
    assert "accepted differently" in check_accept_kernel("cpu")
    monkeypatch.setattr(accept, "accept_stage_triton", broken)
    assert "RuntimeError: no kernel" in check_accept_kernel("cpu")


def test_a_failing_topk_kernel_is_switched_off(monkeypatch):
    from ddtree_sglang import tree
    from ddtree_sglang.kernels import topk

    def wrong(x, k, chunk=4096):
        lp, ids = topk.top_log_probs_reference(x, k)
        return lp, ids.flip(-1)  # right values, wrong ids

    monkeypatch.setattr(topk, "top_log_probs_triton", wrong)
    monkeypatch.setitem(tree.TOPK_KERNEL, "enabled", True)
    assert "disagrees" in tree.check_topk_kernel(100, 8, "cpu", torch.float32)
    assert tree.TOPK_KERNEL["enabled"] is False
    monkeypatch.setitem(tree.TOPK_KERNEL, "enabled", True)
    assert tree.check_topk_kernel(100, 65, "cpu", torch.float32) is None  # not used above 64


def test_kv_moves_of_a_block_narrower_than_the_commit_width():
    """A small budget (N = 3 < out_width = 4) commits at most N tokens: N columns move."""
    from ddtree_sglang.decode_step import kv_moves

    tokens = torch.tensor([[99, 10, 11]])
    parents, depths = torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]])
    step = StepCommit(*accept_stage(tokens, parents, depths, torch.tensor([[10, 11, 5]]),
                                    depth=3, out_width=4))
    assert step.commit_lens.tolist() == [3]
    tgt, src = kv_moves(torch.tensor([20, 21, 22]), step.accept_index, step.commit_lens, 3)
    assert tgt.tolist() == [[20, 21, 22]] and src.tolist() == [[20, 21, 22]]


def test_tree_stage_reports_the_candidates_expected_acceptance():
    from ddtree_sglang.budget import expected_by_depth_per_request
    from ddtree_sglang.decode_step import unpack_tree_stage

    logits = torch.randn(2, 5, 30)
    roots, seq = torch.tensor([1, 2]), torch.tensor([4, 9])
    lay, probs = unpack_tree_stage(tree_stage(logits, roots, seq, 12, 5, build_draft_tree, (3, 12)))
    tree = build_draft_tree(logits, 12)
    assert torch.equal(lay.draft_tokens, build_verify_layout(tree, roots, seq, 5).draft_tokens)
    assert probs.shape == (2, 2, 5)
    assert torch.allclose(probs, expected_by_depth_per_request(tree.scores, tree.depths, [3, 12], 5))
    assert unpack_tree_stage(tree_stage(logits, roots, seq, 12, 5))[1] is None


def test_commit_slots_of_wide_and_narrow_verifies():
    from ddtree_sglang.decode_step import commit_slots

    loc = torch.arange(2 * 6) + 100  # two requests, 6 verify slots each
    assert commit_slots(loc, 2, 6, 4).tolist() == [[100, 101, 102, 103], [106, 107, 108, 109]]
    # narrower than the commit width: the n real slots, then the last one repeated (unwritten)
    assert commit_slots(loc, 2, 6, 8).tolist() == [[100, 101, 102, 103, 104, 105, 105, 105],
                                                   [106, 107, 108, 109, 110, 111, 111, 111]]
