import pytest
import torch

from ddtree_sglang.tree.acceptance import accept_tree, committed_tokens
from ddtree_sglang.tree.verify_layout import build_verify_layout
from ddtree_sglang.sampling.sample import (SamplingParams, draw, filtered_probs, sample_rows,
                                    seeded_uniform, target_choice)
from ddtree_sglang.tree.builder import build_draft_tree


def _norm(p: torch.Tensor) -> torch.Tensor:
    return p / p.sum(dim=-1, keepdim=True)


def test_filters_are_joint_on_the_original_distribution():
    """top-k and top-p are both measured on the unfiltered distribution (SGLang's torch
    sampler, FlashInfer 'joint'), not top-p on the renormalised top-k."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    one = torch.tensor([1.0])
    p = filtered_probs(logits, one, top_k=torch.tensor([2]))
    assert torch.allclose(_norm(p), torch.tensor([[0.625, 0.375, 0, 0]]))
    p = filtered_probs(logits, one, top_p=torch.tensor([0.81]))  # mass before #3: 0.8
    assert torch.allclose(_norm(p), torch.tensor([[0.5, 0.3, 0.15, 0]]) / 0.95)
    p = filtered_probs(logits, one, top_p=torch.tensor([0.79]))
    assert torch.allclose(_norm(p), torch.tensor([[0.625, 0.375, 0, 0]]))
    p = filtered_probs(logits, one, top_k=torch.tensor([3]), top_p=torch.tensor([0.55]))
    assert torch.allclose(_norm(p), torch.tensor([[0.625, 0.375, 0, 0]]))  # 0.5 <= 0.55
    # min-p relative to the top probability: 0.3 x 0.5 = 0.15 keeps the first three.
    p = filtered_probs(logits, one, min_p=torch.tensor([0.3]))
    assert torch.allclose(_norm(p), torch.tensor([[0.5, 0.3, 0.15, 0]]) / 0.95)


def _sglang_torch_filtered(probs, top_k, top_p, min_p, rows=40000, seed=0):
    """Empirical distribution of SGLang 0.5.17's own torch sampler on one row."""
    sampler = pytest.importorskip("sglang.srt.layers.sampler")
    torch.manual_seed(seed)
    batch = probs.expand(rows, -1).contiguous()
    ids = sampler.top_k_top_p_min_p_sampling_from_probs_torch(
        batch, torch.full((rows,), top_k), torch.full((rows,), top_p),
        torch.full((rows,), min_p), min_p > 0, None, None)
    return torch.bincount(ids.long(), minlength=probs.shape[-1]).float() / rows


@pytest.mark.parametrize("top_k,top_p,min_p", [(3, 0.7, 0.0), (5, 0.55, 0.0), (4, 0.9, 0.2),
                                               (2, 1.0, 0.0), (8, 0.45, 0.1)])
def test_filtered_distribution_matches_sglang_torch_sampler(top_k, top_p, min_p):
    """Our filtered distribution equals what SGLang's torch sampler draws from, on
    distributions where the sequential (top-k, renormalise, top-p) order would differ."""
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(1, 8, generator=g) * 1.3
    probs = torch.softmax(logits, -1)
    ours = _norm(filtered_probs(logits, torch.tensor([1.0]), torch.tensor([top_k]),
                                torch.tensor([top_p]), torch.tensor([min_p])))[0]
    emp = _sglang_torch_filtered(probs, top_k, top_p, min_p)
    assert torch.allclose(emp, ours, atol=0.012), (emp, ours)


def test_joint_differs_from_sequential_where_it_should():
    """The case Qwen3's defaults hit: top-p measured on the renormalised top-k keeps fewer
    tokens than the joint rule."""
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    p = _norm(filtered_probs(logits, torch.tensor([1.0]), torch.tensor([3]),
                             torch.tensor([0.75])))
    # joint: mass before #3 is 0.7 <= 0.75 -> keep 3; sequential: 0.444+0.333 = 0.778 > 0.75
    assert (p > 0).sum() == 3


def test_tree_walk_samples_the_target_distribution():
    """Sample-per-node then walk == ancestral sampling from the target (two tokens deep)."""
    vocab, n_req = 4, 40000
    g = torch.Generator().manual_seed(0)
    p1 = torch.tensor([0.4, 0.3, 0.2, 0.1])                      # p(t1)
    p2 = torch.softmax(torch.randn(vocab, vocab, generator=g), -1)  # p(t2 | t1)
    draft = torch.randn(1, 2, vocab, generator=g).expand(n_req, -1, -1)
    tree = build_draft_tree(draft, 5)
    zeros = torch.zeros(n_req, dtype=torch.long)
    lay = build_verify_layout(tree, zeros, zeros)
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


def test_sample_rows_matches_filtered_distribution():
    """The engine-side sampler (exponential-race draw after the filters) samples the
    filtered distribution, row by row, including with the engine's renorm-kernel order."""
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
        sl = slice(r * rows, r * rows + 1)
        ref = _norm(filtered_probs(base[r][None], t[sl], k[sl], p[sl], m[sl]))[0]
        emp = torch.bincount(out[r], minlength=vocab).float() / rows
        assert torch.allclose(emp, ref, atol=0.012), (r, emp, ref)


def test_seeded_draws_are_a_function_of_seed_and_position():
    probs = torch.softmax(torch.randn(4, 50), -1)
    seeds = torch.tensor([7, 7, 8, -1])
    pos = torch.tensor([3, 3, 3, 3])
    a = draw(probs, torch.Generator().manual_seed(0), seeds, pos)
    b = draw(probs, torch.Generator().manual_seed(1), seeds, pos)
    assert torch.equal(a[:3], b[:3])
    u = seeded_uniform(torch.tensor([7, 7]), torch.tensor([3, 4]), 1000)
    assert (u > 0).all() and (u < 1).all() and not torch.equal(u[0], u[1])
    # Uniform enough: mean and spread of 2,000 hashed values
    assert abs(float(u.mean()) - 0.5) < 0.03 and abs(float(u.std()) - 0.2887) < 0.02


def test_seeded_sampling_distribution():
    """Seeded draws over many (seed, position) pairs follow the distribution."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.1])
    rows = 20000
    out = draw(p.expand(rows, -1), None, torch.arange(rows) % 97,
               torch.arange(rows) // 97)
    emp = torch.bincount(out, minlength=4).float() / rows
    assert torch.allclose(emp, p, atol=0.015)


def test_sampling_params_refuse_bad_values():
    for bad in (dict(temperature=float("inf")), dict(temperature=-1.0),
                dict(temperature=float("nan")), dict(top_p=0.0), dict(min_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
