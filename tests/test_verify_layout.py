import pytest
import torch
from hypothesis import given, settings, strategies as st

from ddtree_sglang.tree.verify_layout import build_verify_layout, full_mask, truncate_layout
from ddtree_sglang.tree.builder import build_draft_tree, truncate_tree


def brute_ancestors(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def random_trees(batch, depth, vocab, budget, seed):
    g = torch.Generator().manual_seed(seed)
    return build_draft_tree(torch.randn(batch, depth, vocab, generator=g) * 2, budget)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), budget=st.integers(1, 40), seed=st.integers(0, 999))
def test_ancestors_match_brute_force(batch, budget, seed):
    tree = random_trees(batch, 6, 7, budget, seed)
    layout = build_verify_layout(tree, torch.zeros(batch, dtype=torch.long),
                                 torch.full((batch,), 5))
    for b in range(batch):
        par = layout.tree_parents[b].tolist()
        assert torch.equal(layout.ancestors[b], brute_ancestors(par))
        # Children/sibling links: every non-root node is reachable from its parent's first child.
        nxt, sib = layout.retrieve_next_token[b].tolist(), layout.retrieve_next_sibling[b].tolist()
        for p in range(len(par)):
            kids, c = [], nxt[p]
            while c != -1:
                kids.append(c)
                c = sib[c]
            assert kids == [i for i, q in enumerate(par) if q == p]


def test_positions_tokens_and_full_mask():
    tree = random_trees(2, 15, 50, 12, 1)
    seq_lens = torch.tensor([3, 7])
    roots = torch.tensor([11, 22])
    lay = build_verify_layout(tree, roots, seq_lens)
    n = 13
    assert lay.draft_tokens.view(2, n)[:, 0].tolist() == [11, 22]
    assert torch.equal(lay.draft_tokens.view(2, n)[:, 1:], tree.tokens)
    assert torch.equal(lay.positions.view(2, n), seq_lens[:, None] + lay.tree_depths)
    flat = full_mask(lay.ancestors, seq_lens, int(seq_lens.sum()))
    assert flat.numel() == 10 * n + 2 * n * n
    off = 0
    for b in range(2):
        s = int(seq_lens[b])
        block = flat[off: off + n * (s + n)].view(n, s + n)
        assert bool(block[:, :s].all())
        assert torch.equal(block[:, s:], lay.ancestors[b])
        off += n * (s + n)


def test_full_mask_with_an_upper_bound_on_the_lengths():
    """The worker sizes the mask from a host-side upper bound; blocks must still sit at the
    offsets the attention backends compute from the exact device lengths."""
    tree = random_trees(2, 6, 9, 7, 3)
    seq_lens = torch.tensor([5, 2])
    lay = build_verify_layout(tree, torch.zeros(2, dtype=torch.long), seq_lens)
    n = 8
    exact = full_mask(lay.ancestors, seq_lens, 7)
    bounded = full_mask(lay.ancestors, seq_lens, 7 + 40)
    assert torch.equal(bounded[: exact.numel()], exact)
    assert bool(bounded[exact.numel():].all()) and bounded.numel() == 47 * n + 2 * n * n


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 3), budget=st.integers(2, 40), seed=st.integers(0, 999))
def test_truncated_layout_is_the_layout_of_the_truncated_tree(batch, budget, seed):
    """The batch-aware budget verifies the first b nodes of the B-best tree: slicing the
    B layout must give exactly the layout built from the cut tree, for every b."""
    tree = random_trees(batch, 6, 7, budget, seed)
    roots, seq = torch.arange(batch), torch.arange(batch) * 3 + 2
    full = build_verify_layout(tree, roots, seq, max_depth=6)
    for b in range(1, budget + 1):
        cut = truncate_layout(full, b + 1)
        ref = build_verify_layout(truncate_tree(tree, b), roots, seq, max_depth=6)
        for name in ref.__dataclass_fields__:
            assert torch.equal(getattr(cut, name), getattr(ref, name)), (b, name)
    assert truncate_layout(full, budget + 1) is full
    with pytest.raises(ValueError, match="width must be in 1.."):
        truncate_layout(full, budget + 2)
