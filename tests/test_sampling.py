import torch

from ddtree_sglang.acceptance import accept_tree, committed_tokens
from ddtree_sglang.layout import build_verify_layout
from ddtree_sglang.sampling import SamplingParams, processed_probs, target_choice
from ddtree_sglang.tree import build_draft_tree


def test_processed_probs_top_k_top_p():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    p = processed_probs(logits, torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([2]))
    assert torch.allclose(p, torch.tensor([[[0.625, 0.375, 0, 0]]]))
    p = processed_probs(logits, torch.tensor([1.0]), torch.tensor([0.8]), torch.tensor([0]))
    assert torch.allclose(p, torch.tensor([[[0.625, 0.375, 0, 0]]]))
    p = processed_probs(logits, torch.tensor([1.0]), torch.tensor([0.81]), torch.tensor([0]))
    assert torch.allclose(p, torch.tensor([[[0.5, 0.3, 0.15, 0]]]) / 0.95)


def test_tree_walk_samples_the_target_distribution():
    """Sample-per-node then walk == ancestral sampling from the target (two tokens deep)."""
    vocab, n_req = 4, 40000
    g = torch.Generator().manual_seed(0)
    p1 = torch.tensor([0.4, 0.3, 0.2, 0.1])                      # p(t1)
    p2 = torch.softmax(torch.randn(vocab, vocab, generator=g), -1)  # p(t2 | t1)
    draft = torch.randn(1, 2, vocab, generator=g).expand(n_req, -1, -1)
    tree = build_draft_tree(draft, 5)
    lay = build_verify_layout(tree, torch.zeros(n_req, dtype=torch.long), torch.zeros(n_req, dtype=torch.long))
    n = 6
    toks = lay.draft_tokens.view(n_req, n)
    # Target logits at each node: the root predicts t1; a depth-1 node with token t predicts t2|t.
    logits = torch.empty(n_req, n, vocab)
    logits[:, 0] = p1.log()
    for i in range(1, n):
        logits[:, i] = p2[toks[0, i]].log()
    choice = target_choice(logits, [SamplingParams(temperature=1.0)] * n_req, g)
    acc = accept_tree(toks, lay.tree_parents, lay.tree_depths, choice, max_depth=2)
    out = committed_tokens(toks, acc)
    first = out[:, 0]
    emp1 = torch.bincount(first, minlength=vocab).float() / n_req
    assert torch.allclose(emp1, p1, atol=0.015)
    # Second token where the first was a tree node or the bonus: follow up with the target.
    has_two = acc.accept_len >= 2
    pairs = out[has_two, :2]
    for t in range(vocab):
        sel = pairs[pairs[:, 0] == t, 1]
        if len(sel) > 2000:
            emp = torch.bincount(sel, minlength=vocab).float() / len(sel)
            assert torch.allclose(emp, p2[t], atol=0.03)


def test_sample_rows_matches_processed_distribution():
    """The engine-side sampler (exponential-race draw after temperature / top-k / top-p /
    min-p) samples the same distribution as processed_probs, row by row."""
    from ddtree_sglang.sampling import sample_rows

    g = torch.Generator().manual_seed(1)
    vocab, rows = 6, 30000
    base = torch.randn(3, vocab, generator=g) * 1.5
    logits = base.repeat_interleave(rows, 0)
    t = torch.tensor([0.7, 1.0, 1.3]).repeat_interleave(rows)
    k = torch.tensor([3, 6, 6]).repeat_interleave(rows)
    p = torch.tensor([1.0, 0.8, 1.0]).repeat_interleave(rows)
    m = torch.tensor([0.0, 0.0, 0.2]).repeat_interleave(rows)
    out = sample_rows(logits, t, k, p, m, generator=g).view(3, rows)
    for r in range(3):
        ref = processed_probs(base[r][None, None], t[r * rows: r * rows + 1],
                              p[r * rows: r * rows + 1], k[r * rows: r * rows + 1])[0, 0]
        if r == 2:  # min-p: drop tokens below 0.2 x the top probability, renormalise
            ref = ref * (ref >= 0.2 * ref.max())
            ref = ref / ref.sum()
        emp = torch.bincount(out[r], minlength=vocab).float() / rows
        assert torch.allclose(emp, ref, atol=0.012), (r, emp, ref)
