"""The forced spine (grammar/forcing.py): what the grammar forces, how it enters the tree, and
that outputs do not change (the reference loop on the testbed pair, greedy against masked AR,
seeded sampling against the unforced tree)."""
import pytest
import torch

from ddtree_sglang.tree.builder import build_draft_tree
from ddtree_sglang.grammar.forcing import (FORCED_GAP, SpineStats, force_draft_logits,
                                           forced_rows, forced_tokens)

xgr = pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def pair():
    from ddtree_sglang.reference.testbed import load_testbed

    return load_testbed()


@pytest.fixture(scope="module")
def matchers(pair):
    from ddtree_bench.forced_spine import testbed_grammars

    return testbed_grammars(pair, ["tool_call", "json_bounded", "regex"])


def encoder(pair):
    return lambda s: pair.tokenizer.encode(s, add_special_tokens=False)


def test_the_spine_is_the_forced_string_as_far_as_the_grammar_takes_it(pair, matchers):
    matcher_of, vocab = matchers
    m = matcher_of("tool_call")
    encode = encoder(pair)
    spine = forced_tokens(m, encode, 15)
    text = m.find_jump_forward_string()
    assert text.startswith('[{"name": "get_weather"') and spine  # the schema's scaffolding
    assert spine == encode(text)[:len(spine)] and len(spine) <= 15
    assert m.find_jump_forward_string() == text  # the matcher is left where it was
    assert forced_tokens(m, encode, 2) == spine[:2]
    assert forced_tokens(m, encode, 0) == []
    # a token the grammar refuses ends the spine before it
    bad = lambda s: encode(s)[:1] + [encode("zzz")[0]]  # noqa: E731
    assert forced_tokens(m, bad, 15) == encode(text)[:1]
    free = matcher_of("regex")  # (cat|dog|bird)-...: nothing forced at the start
    assert forced_tokens(free, encode, 15) == []


def test_forced_positions_put_the_spine_first_and_leave_the_rest():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 30, generator=g)
    forced = forced_rows([[7, 3], []], 5)
    assert forced.tolist() == [[7, 3, -1, -1, -1], [-1] * 5]
    out = force_draft_logits(logits, forced)
    assert torch.equal(out[1], logits[1]) and torch.equal(out[0, 2:], logits[0, 2:])
    assert out[0, 0, 7] == 0 and out[0, 0].max() == 0 and out[0, 0].min() == -FORCED_GAP
    tree = build_draft_tree(out, 8)
    # request 0: the spine 7 -> 3 first, then the tree grows below it from positions 3..
    assert tree.tokens[0, :2].tolist() == [7, 3] and tree.parents[0, :2].tolist() == [-1, 0]
    assert (tree.depths[0, 2:] >= 3).all() and torch.isfinite(tree.scores).all()
    ref = build_draft_tree(logits[1:], 8)
    assert torch.equal(tree.tokens[1], ref.tokens[0])


def test_spine_stats_count_what_the_target_took():
    s = SpineStats()
    s.record([], 3)
    s.record([1, 2, 3], 5)
    s.record([4, 5], 0)
    assert (s.steps, s.proposed, s.accepted, s.refused_first) == (2, 5, 3, 1)


@pytest.mark.parametrize("kind", ["tool_call"])  # every kind: benchmarks/forced_spine.py
def test_greedy_outputs_equal_masked_decoding_with_and_without_the_spine(pair, matchers, kind):
    """The reference loop under the grammar: DDTree with the spine, without it, and masked
    autoregressive greedy commit the same tokens; the spine takes some steps' tokens."""
    from ddtree_sglang.reference.constrained import ConstrainedRequest

    matcher_of, vocab = matchers
    spec, prompt = pair.speculator, pair.encode(pair.prompts[0])
    ar = spec.generate(prompt, 28, mode="ar", grammar=ConstrainedRequest(matcher_of(kind), vocab))
    forced = ConstrainedRequest(matcher_of(kind), vocab, encoder(pair), force=True)
    with_spine = spec.generate(prompt, 28, mode="ddtree", budget=15, grammar=forced)
    without = spec.generate(prompt, 28, mode="ddtree", budget=15,
                            grammar=ConstrainedRequest(matcher_of(kind), vocab))
    assert with_spine.tokens == ar.tokens == without.tokens
    assert forced.stats.steps > 0 and forced.stats.accepted > 0


def test_seeded_sampled_outputs_equal_the_unforced_tree_s(pair, matchers):
    """Sampling: a spine's tokens are proposals; with seeded draws (a function of seed and
    position) the committed tokens are the same with and without it."""
    from ddtree_sglang.reference.constrained import ConstrainedRequest
    from ddtree_sglang.sampling.sample import SamplingParams

    matcher_of, vocab = matchers
    spec, prompt = pair.speculator, pair.encode(pair.prompts[1])
    params = SamplingParams(temperature=1.0, seed=11)
    runs = [spec.generate(prompt, 28, mode="ddtree", budget=15, sampling=params,
                          grammar=ConstrainedRequest(matcher_of("tool_call"), vocab,
                                                     encoder(pair), force=force)).tokens
            for force in (False, True)]
    assert runs[0] == runs[1]


def test_force_needs_the_tokenizer(matchers):
    from ddtree_sglang.reference.constrained import ConstrainedRequest

    matcher_of, vocab = matchers
    with pytest.raises(ValueError, match="force needs encode"):
        ConstrainedRequest(matcher_of("regex"), vocab, force=True)


def test_the_spine_s_cost_is_timed_along_a_sample_output(pair, matchers, monkeypatch):
    """benchmarks/forced_spine.py's host-cost column: one spine per position of a sample the
    grammar accepts, its host time per step, the share of positions with a spine and its mean
    length.  A fake clock charges each spine (its length + 1) us, so every column has one
    right value."""
    import statistics
    from types import SimpleNamespace

    import ddtree_bench.forced_spine as forced_spine
    from ddtree_bench.grammars import KINDS
    from ddtree_sglang.grammar import forcing

    now = [1000.0]
    lengths = []
    real = forcing.forced_tokens

    def charged(matcher, encode, depth):
        spine = real(matcher, encode, depth)
        lengths.append(len(spine))
        now[0] += (len(spine) + 1) * 1e-6
        return spine

    monkeypatch.setattr(forced_spine, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(forcing, "forced_tokens", charged)
    matcher_of, _ = matchers
    encode = encoder(pair)
    sample = encode(KINDS["tool_call"].sample)
    cost = forced_spine.spine_cost(matcher_of("tool_call"), sample, encode)
    assert cost["steps"] == len(sample) == len(lengths)
    spines = [n for n in lengths if n]
    assert 0 < len(spines) < len(lengths)  # the scaffolding is forced, the values are not
    assert cost["with_spine"] == round(len(spines) / len(lengths), 3)
    assert cost["spine_len"] == round(statistics.mean(spines), 2) and cost["spine_len"] > 1
    assert cost["us_median"] == pytest.approx(statistics.median(n + 1 for n in lengths), abs=0.05)
    assert cost["us_max"] == pytest.approx(max(lengths) + 1, abs=0.05)


def test_forced_children_take_a_node_s_only_child_and_nothing_else_changes():
    """forced_child_tree: with nothing forced it is the B-best tree; a node after which the
    grammar admits one token gets that token as its only child, with the node's own score."""
    from ddtree_sglang.grammar.forcing import forced_child_tree

    logits = torch.randn(1, 5, 30, generator=torch.Generator().manual_seed(0))
    lp = torch.log_softmax(logits, -1)[0]
    free = forced_child_tree(lp, 12, lambda prefix: None)
    ref = build_draft_tree(logits, 12)
    assert torch.equal(free.tokens, ref.tokens) and torch.equal(free.parents, ref.parents)
    assert torch.allclose(free.scores, ref.scores)
    first = int(ref.tokens[0, 0])
    tree = forced_child_tree(lp, 12, lambda prefix: 7 if prefix == (first,) else None)
    kids = (tree.parents[0] == 0).nonzero().view(-1).tolist()  # the children of node 0
    assert [int(tree.tokens[0, c]) for c in kids] == [7]
    assert torch.isclose(tree.scores[0, kids[0]], tree.scores[0, 0])
    assert (tree.parents[0, 1:] < torch.arange(1, 12)).all()  # parents before children


def test_greedy_outputs_with_forced_children_equal_masked_decoding(pair, matchers):
    from ddtree_sglang.reference.constrained import ConstrainedRequest

    matcher_of, vocab = matchers
    spec, prompt = pair.speculator, pair.encode(pair.prompts[2])
    ar = spec.generate(prompt, 24, mode="ar",
                       grammar=ConstrainedRequest(matcher_of("regex"), vocab))
    req = ConstrainedRequest(matcher_of("regex"), vocab, encoder(pair), force=True,
                             force_children=True)
    assert spec.generate(prompt, 24, mode="ddtree", budget=15, grammar=req).tokens == ar.tokens
