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
