import pytest
import torch

from ddtree_sglang.tree.stages import StepCommit, accept_stage, tree_stage, unpack_tree_stage
from ddtree_sglang.tree.verify_layout import build_verify_layout, full_mask
from ddtree_sglang.tree.builder import build_draft_tree


def test_tree_stage_is_build_plus_layout():
    logits = torch.randn(3, 15, 50)
    roots, seq = torch.tensor([1, 2, 3]), torch.tensor([4, 9, 0])
    out = unpack_tree_stage(tree_stage(logits, roots, seq, 20, 15, build_draft_tree), 20)
    lay, positions = out.layouts[21], out.mask_positions
    ref = build_verify_layout(build_draft_tree(logits, 20), roots, seq, max_depth=15)
    assert out.depth_probs is None and list(positions) == [21] and list(out.layouts) == [21]
    assert torch.equal(out.seq_lens, seq)
    assert torch.equal(full_mask(lay.ancestors, seq, 13, positions[21]),
                       full_mask(ref.ancestors, seq, 13))
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


def test_commit_stage_is_the_walk_plus_the_commit_s_slots():
    """commit_stage computes, with the walk, what the commit used to compute after it: the KV
    moves, the draft-KV slots and chain positions, the new lengths."""
    from ddtree_sglang.tree.stages import commit_slots, commit_stage, kv_moves, unpack_commit_stage

    tokens = torch.tensor([[99, 10, 11, 12, 13, 14]] * 2)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3]] * 2)
    depths = torch.tensor([[0, 1, 1, 2, 2, 3]] * 2)
    choice = torch.tensor([[10, 12, 0, 14, 0, 8], [11, 0, 5, 0, 0, 0]])
    loc = torch.arange(100, 112).view(2, 6)
    seq = torch.tensor([7, 20])
    step, slots = unpack_commit_stage(commit_stage(accept_stage, tokens, parents, depths, choice,
                                                   loc, seq, 3, 4))
    ref = StepCommit(*accept_stage(tokens, parents, depths, choice, depth=3, out_width=4))
    assert all(torch.equal(a, b) for a, b in zip(vars(step).values(), vars(ref).values()))
    tgt, src = kv_moves(loc.reshape(-1), ref.accept_index, ref.commit_lens, 6)
    assert torch.equal(slots.kv_target, tgt) and torch.equal(slots.kv_source, src)
    assert torch.equal(slots.draft_slots, commit_slots(loc.reshape(-1), 2, 6, 4))
    assert slots.draft_positions.tolist() == [[7, 8, 9, 10], [20, 21, 22, 23]]
    assert slots.new_seq_lens.tolist() == [11, 22] and slots.new_seq_lens.dtype == seq.dtype


def test_kv_moves_put_the_accepted_path_at_its_positions():
    """Slot contents are node ids; after the moves, position j of each request holds the j-th
    node of its accepted path (root first), whatever order the moves read and write in."""
    pytest.importorskip("triton", reason="the move reference lives beside its Triton kernel")
    from ddtree_sglang.tree.stages import kv_moves
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


def test_kv_moves_of_a_block_narrower_than_the_commit_width():
    """A small budget (N = 3 < out_width = 4) commits at most N tokens: N columns move."""
    from ddtree_sglang.tree.stages import kv_moves

    tokens = torch.tensor([[99, 10, 11]])
    parents, depths = torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]])
    step = StepCommit(*accept_stage(tokens, parents, depths, torch.tensor([[10, 11, 5]]),
                                    depth=3, out_width=4))
    assert step.commit_lens.tolist() == [3]
    tgt, src = kv_moves(torch.tensor([20, 21, 22]), step.accept_index, step.commit_lens, 3)
    assert tgt.tolist() == [[20, 21, 22]] and src.tolist() == [[20, 21, 22]]


def test_tree_stage_reports_the_candidates_expected_acceptance_and_mask_positions():
    """With candidate budgets the tree stage also gives their expected acceptance, and the
    verify mask's positions of every candidate width: a mask built from them equals the one
    full_mask builds on the host, for the tree cut to that width."""
    from ddtree_sglang.budget.controller import expected_by_depth_per_request
    from ddtree_sglang.tree.stages import stage_widths
    from ddtree_sglang.tree.verify_layout import truncate_layout

    logits = torch.randn(2, 5, 30)
    roots, seq = torch.tensor([1, 2]), torch.tensor([4, 9])
    widths = stage_widths(12, (3, 12))
    assert widths == (4, 13)
    out = unpack_tree_stage(tree_stage(logits, roots, seq, 12, 5, build_draft_tree, (3, 12)),
                            12, (3, 12))
    tree = build_draft_tree(logits, 12)
    full = build_verify_layout(tree, roots, seq, 5)
    assert torch.equal(out.layouts[13].draft_tokens, full.draft_tokens)
    assert out.depth_probs.shape == (2, 2, 5)
    assert torch.allclose(out.depth_probs,
                          expected_by_depth_per_request(tree.scores, tree.depths, [3, 12], 5))
    for w in widths:  # each width's layout is the tree cut to it, and its mask positions
        cut = truncate_layout(full, w)
        for name in ("draft_tokens", "positions", "ancestors", "retrieve_index",
                     "retrieve_next_token", "retrieve_next_sibling", "tree_parents",
                     "tree_depths"):
            assert torch.equal(getattr(out.layouts[w], name), getattr(cut, name)), (w, name)
        assert torch.equal(full_mask(cut.ancestors, seq, 20, out.mask_positions[w]),
                           full_mask(cut.ancestors, seq, 20))
    assert unpack_tree_stage(tree_stage(logits, roots, seq, 12, 5, build_draft_tree),
                             12).depth_probs is None
    assert stage_widths(200, (63, 200)) == (64,)  # wide verifies place their mask on the host
    wide = unpack_tree_stage(tree_stage(logits, roots, seq, 200, 5, build_draft_tree, (63, 200)),
                             200, (63, 200))
    assert list(wide.layouts) == [64, 201] and list(wide.mask_positions) == [64]


def test_commit_slots_of_wide_and_narrow_verifies():
    from ddtree_sglang.tree.stages import commit_slots

    loc = torch.arange(2 * 6) + 100  # two requests, 6 verify slots each
    assert commit_slots(loc, 2, 6, 4).tolist() == [[100, 101, 102, 103], [106, 107, 108, 109]]
    # narrower than the commit width: the n real slots, then the last one repeated (unwritten)
    assert commit_slots(loc, 2, 6, 8).tolist() == [[100, 101, 102, 103, 104, 105, 105, 105],
                                                   [106, 107, 108, 109, 110, 111, 111, 111]]
