import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_sglang.tree.verify_layout import build_verify_layout
from ddtree_sglang.sampling.penalties import (PenaltyParams, RequestPenalties, apply_tree_penalties,
                                     path_tokens, reference_node_penalties)
from ddtree_sglang.reference.loop import ReferenceSpeculator
from ddtree_sglang.reference.tiny import tiny_pair
from ddtree_sglang.sampling.sample import SamplingParams
from ddtree_sglang.tree.builder import build_draft_tree


def _tree(bs, vocab, depth, budget, seed):
    g = torch.Generator().manual_seed(seed)
    # Peaked draft rows with few distinct tokens so paths repeat tokens and hit the history.
    logits = torch.randn(bs, depth, vocab, generator=g) * 3
    tree = build_draft_tree(logits, budget)
    roots = torch.randint(0, vocab, (bs,), generator=g)
    return build_verify_layout(tree, roots, torch.zeros(bs, dtype=torch.long), max_depth=depth)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), freq=st.sampled_from([0.0, 0.3, 1.5, -0.7]),
       pres=st.sampled_from([0.0, 1.5, -0.4]), rep=st.sampled_from([1.0, 1.8, 0.6]),
       min_new=st.integers(0, 12))
def test_tree_penalties_equal_plain_per_node(seed, freq, pres, rep, min_new):
    """Every node's penalised logits = plain decoding's at that node: the request's history
    (root included) plus the node's own path, written densely and independently."""
    bs, vocab, depth, budget = 2, 12, 4, 10
    lay = _tree(bs, vocab, depth, budget, seed)
    n = budget + 1
    g = torch.Generator().manual_seed(seed + 1)
    logits = torch.randn(bs, n, vocab, generator=g) * 4
    histories = [torch.randint(0, vocab, (int(torch.randint(0, 9, (1,), generator=g)),),
                               generator=g).tolist() for _ in range(bs)]
    tokens = lay.draft_tokens.view(bs, n)
    for b in range(bs):
        histories[b].append(int(tokens[b, 0]))  # the root is the last committed output
    counts = torch.stack([torch.bincount(torch.tensor(h), minlength=vocab) for h in histories])
    out_len = torch.tensor([len(h) for h in histories])
    stops = [{3, 7}, set()]
    params = PenaltyParams.from_lists([freq, freq / 2], [pres, 0.0], [rep, 1.0],
                                      [min_new, min_new + 3], stops, "cpu")
    paths = path_tokens(tokens, lay.tree_parents, lay.tree_depths, depth)
    got = apply_tree_penalties(logits.clone(), counts, out_len, params, paths, lay.tree_depths)
    for b in range(bs):
        for j in range(n):
            path = [int(t) for t in paths[b, j] if t >= 0][::-1]
            want = reference_node_penalties(
                logits[b, j], histories[b] + path, vocab, float(params.frequency[b]),
                float(params.presence[b]), float(params.repetition[b]),
                int(params.min_new_tokens[b]), stops[b])
            assert torch.allclose(got[b, j], want, atol=1e-5, equal_nan=True), (b, j)
            assert torch.equal(torch.isinf(got[b, j]), torch.isinf(want))


def test_path_tokens_follow_parents():
    lay = _tree(1, 9, 3, 7, seed=4)
    tokens = lay.draft_tokens.view(1, -1)
    paths = path_tokens(tokens, lay.tree_parents, lay.tree_depths, 3)
    assert (paths[0, 0] == -1).all()  # the root has no path
    for j in range(1, tokens.shape[1]):
        d = int(lay.tree_depths[0, j])
        assert int(paths[0, j, 0]) == int(tokens[0, j])
        assert int((paths[0, j] >= 0).sum()) == d
        parent = int(lay.tree_parents[0, j])
        if parent > 0:
            assert torch.equal(paths[0, j, 1:d], paths[0, parent, : d - 1])


def test_request_penalties_refuse_bad_values():
    for bad in (dict(frequency=2.5), dict(presence=-3.0), dict(repetition=0.0),
                dict(repetition=2.5), dict(min_new_tokens=-1)):
        with pytest.raises(ValueError):
            RequestPenalties(**bad)
    assert not RequestPenalties().active and RequestPenalties(min_new_tokens=2).active


@pytest.fixture(scope="module")
def spec():
    target, drafter = tiny_pair(vocab=48, seed=3)
    return ReferenceSpeculator(target, drafter, eos_token_ids=(2,))


PEN = [RequestPenalties(frequency=1.5), RequestPenalties(presence=1.5),
       RequestPenalties(repetition=1.8), RequestPenalties(frequency=0.4, presence=-0.5,
                                                          repetition=1.3),
       RequestPenalties(min_new_tokens=30, stop_tokens=frozenset({2}))]


@pytest.mark.parametrize("pen", PEN)
def test_greedy_with_penalties_equals_autoregressive(spec, pen):
    """DDTree and the chain under penalties give plain decoding's greedy output."""
    prompt = [5, 17, 33, 8, 9, 5, 17]
    ar = spec.generate(prompt, 40, mode="ar", penalties=pen)
    plain = spec.generate(prompt, 40, mode="ar")
    assert ar.tokens != plain.tokens or pen.min_new_tokens  # the penalty matters here
    for budget in (4, 16, 40):
        tree = spec.generate(prompt, 40, mode="ddtree", budget=budget, penalties=pen)
        assert tree.tokens == ar.tokens, f"B={budget}"
    assert spec.generate(prompt, 40, mode="chain", penalties=pen).tokens == ar.tokens


def test_min_new_tokens_suppresses_eos(spec):
    """With EOS boosted, min_new_tokens holds it off for exactly that many tokens."""
    real = spec.lm_head.weight.data.clone()
    spec.lm_head.weight.data[2] += 0.6 * spec.lm_head.weight.data.abs().mean() * 40
    try:
        prompt = [5, 17, 33]
        free = spec.generate(prompt, 30, mode="ar")
        assert len(free.tokens) < 10 and free.tokens[-1] == 2
        pen = RequestPenalties(min_new_tokens=12, stop_tokens=frozenset({2}))
        ar = spec.generate(prompt, 30, mode="ar", penalties=pen)
        assert 2 not in ar.tokens[:11]
        tree = spec.generate(prompt, 30, mode="ddtree", budget=16, penalties=pen)
        assert tree.tokens == ar.tokens
    finally:
        spec.lm_head.weight.data.copy_(real)


def test_seeded_sampling_is_identical_across_modes(spec):
    """A seeded draw depends on (seed, position, distribution) only, so AR, the chain and
    DDTree of any budget emit the same sampled tokens, penalties included."""
    prompt = [40, 41, 42, 7]
    sp = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=1234)
    pen = RequestPenalties(frequency=0.5)
    ar = spec.generate(prompt, 30, mode="ar", sampling=sp, penalties=pen, seed=1)
    for mode, budget in (("chain", 1), ("ddtree", 4), ("ddtree", 32)):
        out = spec.generate(prompt, 30, mode=mode, budget=budget, sampling=sp, penalties=pen,
                            seed=99)
        assert out.tokens == ar.tokens, (mode, budget)
    other = spec.generate(prompt, 30, mode="ar",
                          sampling=SamplingParams(temperature=1.0, top_k=20, top_p=0.9,
                                                  seed=4321), penalties=pen)
    assert other.tokens != ar.tokens
