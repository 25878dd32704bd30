"""sglang_plugin/grammar_stage.py: which constrained request gets tree masks and which walks its
path under each SGLANG_DDTREE_GRAMMAR method, the cost evidence `auto` decides by, and tree masks
filled on threads equal to serial ones (real xgrammar matchers, the testbed's tokenizer)."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
pytest.importorskip("sglang")

from ddtree_bench.grammars import KINDS  # noqa: E402
from ddtree_sglang.grammar.masks import allow_all, fill_tree_masks  # noqa: E402
from ddtree_sglang.tree.verify_layout import sibling_links  # noqa: E402
from ddtree_sglang.sglang_plugin import sglang_api as sg  # noqa: E402
from ddtree_sglang.sglang_plugin.settings import GRAMMAR_METHODS  # noqa: E402
from ddtree_sglang.sglang_plugin.grammar_stage import (WALK_ABOVE_US, MaskCosts,  # noqa: E402
                                                       build_grammar_step)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ROOT / "testbed" / "target"))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    comp = xgr.GrammarCompiler(info, max_threads=1)
    kind = KINDS["json_bounded"]
    compiled = comp.compile_json_schema(kind.value, any_whitespace=False)
    sample = tok.encode(kind.sample, add_special_tokens=False)
    return info.vocab_size, compiled, sample


def request(rid, compiled, vocab, sample, top_k=1, logprobs=False):
    m = xgr.GrammarMatcher(compiled)
    for t in sample[:6]:
        assert m.accept_token(t)
    grammar = sg.XGrammarGrammar(m, vocab, compiled, None)
    return SimpleNamespace(rid=rid, grammar=grammar, return_logprob=logprobs,
                           sampling_params=SimpleNamespace(top_k=top_k))


def links(sample, bs):
    """A tree per request: the sample's next tokens as a chain with a sibling at each depth."""
    toks = sample[5:12]
    parents, tokens = [-1], [toks[0]]
    for d, t in enumerate(toks[1:]):
        chain_parent = 0 if d == 0 else len(tokens) - 2
        parents += [chain_parent, chain_parent]
        tokens += [t, (t + 7) % 4000]
    first, nxt = sibling_links(torch.tensor([parents]))
    rep = lambda x: x.expand(bs, -1).contiguous()  # noqa: E731
    return rep(first), rep(nxt), rep(torch.tensor([tokens])), len(tokens)


@pytest.mark.parametrize("method", GRAMMAR_METHODS)
def test_who_walks_and_who_gets_masks(setup, method):
    vocab, compiled, sample = setup
    reqs = [request("greedy", compiled, vocab, sample),
            request("sampled", compiled, vocab, sample, top_k=50),
            request("logprobs", compiled, vocab, sample, logprobs=True),
            SimpleNamespace(rid="free", grammar=None)]
    first, nxt, tokens, width = links(sample, len(reqs))
    costs = MaskCosts({"greedy": 10 * WALK_ABOVE_US, "sampled": 10 * WALK_ABOVE_US})
    step = build_grammar_step(reqs, (first, nxt, tokens), width, vocab, "cpu", method, costs)
    walks = method in ("path", "auto")
    assert step.greedy.rows == ((0,) if walks else ())  # greedy: the top-K walk
    # the others walk with a mask per visited node: under path all, under auto the costly
    sampled = {"path": (1, 2), "auto": (1,)}.get(method, ())
    assert step.sampled.rows == sampled and len(step.sampled.walks) == len(sampled)
    tree_masked = [i for i in (0, 1, 2) if i not in step.greedy.rows + sampled]
    if not tree_masked:
        assert step.mask is None
        return
    rows = step.mask.vocab_mask.view(len(reqs), width, -1)
    for i in range(4):  # walked and unconstrained requests' rows allow everything
        assert bool((rows[i] == -1).all()) == (i not in tree_masked), i
    expect = allow_all(width, vocab)
    fill_tree_masks(reqs[2].grammar.matcher, first[2], nxt[2], tokens[2], expect)
    assert torch.equal(rows[2], expect)
    # evidence: measured for masked requests, decayed for walked ones, finished ones dropped
    assert costs.us["logprobs"] > 0 and "free" not in costs.us
    if walks:
        assert costs.us["greedy"] == pytest.approx(9 * WALK_ABOVE_US)


def test_auto_walks_only_costly_requests_and_retries_tree_masks(setup, monkeypatch):
    """A fake clock charges each request's tree masks a fixed cost (cheap: 20 us, costly:
    5 x WALK_ABOVE_US), so each step has one outcome: the costly request walks, its evidence
    decays below the threshold, it retries tree masks, is measured costly and walks again;
    the cheap one always gets tree masks, measured at its cost."""
    from ddtree_sglang.sglang_plugin import grammar_stage

    vocab, compiled, sample = setup
    reqs = [request("cheap", compiled, vocab, sample), request("costly", compiled, vocab, sample)]
    charge = {id(reqs[0].grammar.matcher): 20.0, id(reqs[1].grammar.matcher): 5 * WALK_ABOVE_US}
    now = [50.0]

    def charged_fill(matcher, *args):
        fill_tree_masks(matcher, *args)
        now[0] += charge[id(matcher)] * 1e-6

    monkeypatch.setattr(grammar_stage, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(grammar_stage, "fill_tree_masks", charged_fill)
    first, nxt, tokens, width = links(sample, 2)
    costs = MaskCosts({"cheap": 1.0, "costly": 1.05 * WALK_ABOVE_US})

    def step():
        return build_grammar_step(reqs, (first, nxt, tokens), width, vocab, "cpu", "auto",
                                  costs).greedy.rows

    assert step() == (1,)  # costly walks, cheap gets masks
    assert costs.us["cheap"] == pytest.approx(20.0)
    assert costs.us["costly"] == pytest.approx(1.05 * WALK_ABOVE_US * grammar_stage.DECAY)
    assert step() == ()  # costly retries tree masks, and is measured
    assert costs.us == pytest.approx({"cheap": 20.0, "costly": 5 * WALK_ABOVE_US})
    assert step() == (1,)  # and walks again


def test_threaded_tree_masks_equal_serial_ones(setup):
    vocab, compiled, sample = setup
    reqs = [request(f"r{i}", compiled, vocab, sample, top_k=20) for i in range(6)]
    first, nxt, tokens, width = links(sample, len(reqs))
    costs = MaskCosts({f"r{i}": 1e6 for i in range(6)})  # all costly: the thread pool fills
    step = build_grammar_step(reqs, (first, nxt, tokens), width, vocab, "cpu", "tree", costs)
    assert costs.pool is not None
    serial = allow_all(len(reqs) * width, vocab)
    for i, r in enumerate(reqs):
        fill_tree_masks(r.grammar.matcher, first[i], nxt[i], tokens[i],
                        serial[i * width:(i + 1) * width])
    assert torch.equal(step.mask.vocab_mask, serial)
    assert all(v < 1e6 for v in costs.us.values())  # re-measured


def test_auto_stops_walking_a_request_whose_walk_costs_more_than_its_masks(setup):
    """The walk's own host time is measured too: a request whose walk (its fallback mask
    fills) costs more than its tree masks goes back to tree masks."""
    from ddtree_sglang.sglang_plugin.grammar_stage import grammar_choices

    vocab, compiled, sample = setup
    reqs = [request("r", compiled, vocab, sample)]
    first, nxt, tokens, width = links(sample, 1)
    costs = MaskCosts({"r": 2 * WALK_ABOVE_US})
    step = build_grammar_step(reqs, (first, nxt, tokens), width, vocab, "cpu", "auto", costs)
    assert step.greedy.rows == (0,) and step.greedy.rids == ("r",)
    logits = torch.zeros(width, vocab)
    logits[:, vocab - 1] = 5.0  # the target prefers a token the grammar forbids: mask fills
    grammar_choices(step, logits, logits.argmax(-1).view(1, -1), width, vocab, costs)
    assert costs.walk_us["r"] > 0
    costs.walk_us["r"] = 10 * costs.us["r"]  # this walk cost more than the masks would
    again = build_grammar_step(reqs, (first, nxt, tokens), width, vocab, "cpu", "auto", costs)
    assert again.greedy.rows == ()
    costs.keep_only(set())
    assert costs.walk_us == {} and costs.us == {}


def test_grammar_spines_ask_each_native_grammar_with_its_request_s_tokenizer(setup):
    """The spine rows the tree stage takes: each request's forced continuation, tokenized by
    its own tokenizer; none for a request without a native grammar or without a tokenizer."""
    from transformers import AutoTokenizer

    from ddtree_sglang.grammar.forcing import forced_tokens
    from ddtree_sglang.sglang_plugin.grammar_stage import grammar_spines

    vocab, compiled, sample = setup
    tok = AutoTokenizer.from_pretrained(str(ROOT / "testbed" / "target"))
    forced = SimpleNamespace(grammar=sg.XGrammarGrammar(xgr.GrammarMatcher(compiled), vocab,
                                                        compiled, None), tokenizer=tok)
    no_tokenizer = request("b", compiled, vocab, sample)
    no_tokenizer.tokenizer = None
    other = SimpleNamespace(grammar=object(), tokenizer=tok)  # not xgrammar's
    rows = grammar_spines([forced, no_tokenizer, other, SimpleNamespace(grammar=None,
                                                                        tokenizer=tok)], 5, "cpu")
    want = forced_tokens(forced.grammar.matcher,
                         lambda s: tok.encode(s, add_special_tokens=False), 5)
    assert want and rows[0, :len(want)].tolist() == want and (rows[1:] == -1).all()
    assert rows.shape == (4, 5) and rows.dtype == torch.int64
