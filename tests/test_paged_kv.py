"""Paged KV (page sizes 1 / 16 / 64): the commit's slot and move arithmetic (step_ops.
commit_stage) against a reference built token by token from a paged request-to-slot table.

SGLang gives position p of a request the slot page[p // P] * P + p % P, its pages anywhere in
the pool; the verify's tokens hold the positions after the committed ones.  After the moves,
the KV of position seq_len + j must be the j-th accepted node's (root first), and the draft-KV
append must write position seq_len + j at that position's slot, across page boundaries."""
import pytest
import torch

from ddtree_sglang.tree.builder import build_draft_tree
from ddtree_sglang.tree.stages import accept_stage, commit_stage, unpack_commit_stage
from ddtree_sglang.tree.verify_layout import build_verify_layout

BS, DEPTH, VOCAB, BUDGET, ROW = 4, 6, 12, 14, 256


def paged_table(page: int, gen: torch.Generator) -> torch.Tensor:
    """[BS, ROW] slot of every position, pages shuffled across the pool."""
    pages = ROW // page
    order = torch.randperm(BS * pages, generator=gen)
    table = torch.empty(BS, ROW, dtype=torch.int64)
    for r in range(BS):
        for p in range(ROW):
            table[r, p] = order[r * pages + p // page] * page + p % page
    return table


@pytest.mark.parametrize("page", [1, 16, 64])
def test_commit_slots_and_moves_follow_the_paged_positions(page):
    gen = torch.Generator().manual_seed(page)
    table = paged_table(page, gen)
    seq = torch.tensor([5, 14, 63, 120])  # verify blocks that cross page boundaries
    tree = build_draft_tree(torch.randn(BS, DEPTH, VOCAB, generator=gen), BUDGET)
    lay = build_verify_layout(tree, torch.randint(0, VOCAB, (BS,), generator=gen), seq)
    n, width = BUDGET + 1, DEPTH + 1
    tokens = lay.draft_tokens.view(BS, n)
    choice = torch.where(torch.rand(BS, n, generator=gen) < 0.7,
                         tokens.roll(-1, 1), torch.randint(0, VOCAB, (BS, n), generator=gen))
    verify_slots = torch.stack([table[r, seq[r]:seq[r] + n] for r in range(BS)])
    step, slots = unpack_commit_stage(commit_stage(
        accept_stage, tokens, lay.tree_parents, lay.tree_depths, choice, verify_slots, seq,
        DEPTH, width))
    kv = torch.full((BS * ROW, 1), -1, dtype=torch.int64)
    kv[verify_slots.reshape(-1), 0] = torch.arange(BS * n)  # each slot holds its node's row
    moved = kv[slots.kv_source.reshape(-1)].clone()  # every source read before any write
    kv[slots.kv_target.reshape(-1)] = moved
    for r in range(BS):  # the reference, token by token
        k = int(step.commit_lens[r])
        path = step.accept_index[r, :k].tolist()
        assert path[0] == r * n  # the root first
        for j in range(k):
            position = int(seq[r]) + j
            assert int(kv[table[r, position], 0]) == path[j], (page, r, j)
            assert int(slots.draft_slots[r, j]) == int(table[r, position])
            assert int(slots.draft_positions[r, j]) == position
        assert int(slots.new_seq_lens[r]) == int(seq[r]) + k
