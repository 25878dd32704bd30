"""grammar_masks against full masks, with real xgrammar grammars on the testbed's tokenizer:
the native tree masks equal SGLang's Python traversal at every node the grammar allows, and the
greedy path walk
commits exactly what the full masks' argmax and the acceptance walk commit, on random trees,
grammars and logits (ties, penalties' -inf, the target preferring forbidden tokens)."""
import json
import random
from pathlib import Path

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from ddtree_sglang.tree.acceptance import accept_tree, committed_tokens  # noqa: E402
from ddtree_sglang.grammar.masks import (PathWalk, allow_all, fill_tree_masks,  # noqa: E402
                                         first_allowed, follow_paths, masked_argmax,
                                         unpack_bitmask)
from ddtree_sglang.tree.verify_layout import sibling_links  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {
    "name": {"enum": ["ada", "bob", "cy"]}, "ok": {"type": "boolean"},
    "n": {"type": "integer"}, "s": {"type": "string", "maxLength": 6}},
    "required": ["name", "ok", "n", "s"], "additionalProperties": False}
REGEX = r"(cat|dog|bird)-[0-9]{2,3}-(red|blue)"
EBNF = 'root ::= answer " " num\nanswer ::= "yes" | "no" | "maybe"\nnum ::= [0-9] [0-9]?'


@pytest.fixture(scope="module")
def grammars():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ROOT / "testbed" / "target"))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    comp = xgr.GrammarCompiler(info, max_threads=1)
    return info.vocab_size, {
        "json": comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False),
        "regex": comp.compile_regex(REGEX),
        "ebnf": comp.compile_grammar(EBNF)}


def allowed_ids(matcher, vocab: int) -> list[int]:
    mask = allow_all(1, vocab)
    matcher.fill_next_token_bitmask(mask, 0)
    return unpack_bitmask(mask, vocab)[0].nonzero().view(-1).tolist()


def random_tree(matcher, vocab: int, n: int, rng: random.Random, depth: int = 6):
    """parents [n] and tokens [n] of a tree whose nodes are mostly grammar-valid children
    (as a good drafter's are), some not; sibling tokens distinct."""
    parents, tokens, paths = [-1], [0], [[]]
    while len(tokens) < n:
        p = rng.randrange(len(tokens))
        if len(paths[p]) >= depth:
            continue
        taken_in = sum(bool(matcher.accept_token(t)) for t in paths[p])
        valid_path = taken_in == len(paths[p]) and not matcher.is_terminated()
        ok = allowed_ids(matcher, vocab) if valid_path else []
        if taken_in:
            matcher.rollback(taken_in)
        taken = {tokens[c] for c in range(len(tokens)) if parents[c] == p}
        pool = [t for t in ok if t not in taken] if ok and rng.random() < 0.85 else \
            [t for t in rng.sample(range(vocab), 8) if t not in taken]
        if not pool:
            continue
        t = rng.choice(pool)
        parents.append(p), tokens.append(t), paths.append(paths[p] + [t])
    return torch.tensor(parents), torch.tensor(tokens), paths


def target_logits(paths, tokens, vocab: int, rng: random.Random, gen) -> torch.Tensor:
    """[n, V] logits that often rank a child's token first (long accepted paths), sometimes a
    token the grammar forbids, with ties and -inf entries."""
    n = len(paths)
    logits = torch.randn(n, vocab, generator=gen).round(decimals=1)  # ties
    logits[:, rng.sample(range(vocab), 30)] = float("-inf")
    for node in range(n):
        kids = [c for c in range(n) if paths[c][:-1] == paths[node] and len(paths[c]) ==
                len(paths[node]) + 1]
        r = rng.random()
        if kids and r < 0.7:
            logits[node, tokens[rng.choice(kids)]] = 9.0
        elif r < 0.85:  # near the top but below a forbidden favourite
            logits[node, rng.randrange(vocab)] = 8.0
    return logits


def random_cases(compiled, vocab: int, seed: int, trials: int, size: int):
    """(trial, fresh matcher, parents, tokens, paths, target logits) of random trees."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for trial in range(trials):
        matcher = xgr.GrammarMatcher(compiled)
        parents, tokens, paths = random_tree(matcher, vocab, size, rng)
        yield trial, matcher, parents, tokens, paths, target_logits(paths, tokens, vocab, rng,
                                                                   gen)


def full_mask_choice(matcher, next_tok, next_sib, tokens, logits, vocab):
    mask = allow_all(len(tokens), vocab)
    fill_tree_masks(matcher, next_tok, next_sib, tokens, mask)
    return masked_argmax(logits, mask), mask


@pytest.mark.parametrize("kind", ["json", "regex", "ebnf"])
def test_native_tree_masks_equal_sglang_s_python_traversal(grammars, kind):
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar
    from sglang.srt.speculative.spec_utils import traverse_tree

    vocab, compiled = grammars
    rng, n = random.Random(7), 24
    for trial in range(6):
        m = xgr.GrammarMatcher(compiled[kind], max_rollback_tokens=200)
        parents, tokens, _ = random_tree(m, vocab, n, rng)
        next_tok, next_sib = sibling_links(parents.view(1, -1))
        native = allow_all(n, vocab)
        fill_tree_masks(m, next_tok[0], next_sib[0], tokens, native)
        python = allow_all(n, vocab)
        traverse_tree(next_tok[0], next_sib[0], tokens,
                      XGrammarGrammar(m, vocab, compiled[kind], None), python, vocab_size=vocab)
        assert torch.equal(native, python), (kind, trial)
        assert allowed_ids(m, vocab) == allowed_ids(xgr.GrammarMatcher(compiled[kind]), vocab)


def test_first_allowed_needs_a_value_above_the_k_th():
    class Evens:
        def accept_token(self, t):
            return t % 2 == 0

        def rollback(self, k):
            pass

    m = Evens()
    assert first_allowed(m, [5.0, 4.0, 3.0, 1.0], [3, 8, 6, 1]) == 8
    assert first_allowed(m, [5.0, 4.0, 4.0, 4.0], [3, 9, 8, 2]) is None  # 8 ties the K-th
    assert first_allowed(m, [5.0, 4.0, 4.0, 1.0], [3, 9, 8, 2]) == 8
    assert first_allowed(m, [4.0, 4.0, 2.0], [6, 2, 1]) == 2  # ties go to the lower id
    assert first_allowed(m, [5.0, 1.0], [3, 1]) is None  # nothing allowed above the K-th
    assert first_allowed(m, [5.0, 1.0], [3, 1], vocab_complete=True) is None
    assert first_allowed(m, [5.0, 1.0], [3, 4], vocab_complete=True) == 4


@pytest.mark.parametrize("top_k", [1, 4, 16])
def test_path_walk_commits_what_full_masks_commit(grammars, top_k):
    """Batch of requests (grammars mixed, one unconstrained row left to the device): the walk's
    choices give the same accepted path and bonus as the full masks', every matcher ends where
    it started, and the walk fills fewer masks than the tree has nodes."""
    vocab, compiled = grammars
    rng, gen, n, bs = random.Random(3), torch.Generator().manual_seed(3), 20, 4
    kinds = ["json", "regex", "ebnf"]
    total_masks = 0
    for trial in range(8):
        matchers, parents, tokens, logits = [], [], [], []
        for b in range(bs):
            m = xgr.GrammarMatcher(compiled[kinds[(trial + b) % 3]], max_rollback_tokens=200)
            for t in allowed_ids(m, vocab)[: rng.randrange(3)]:  # a prefix already committed
                m.accept_token(t)
                break
            p, tk, paths = random_tree(m, vocab, n, rng)
            matchers.append(m), parents.append(p), tokens.append(tk)
            logits.append(target_logits(paths, tk.tolist(), vocab, rng, gen))
        parents, tokens = torch.stack(parents), torch.stack(tokens)
        logits = torch.cat(logits)
        depths = torch.zeros_like(parents)
        for j in range(1, n):
            depths[:, j] = depths.gather(1, parents[:, j:j + 1].clamp(min=0)).view(-1) + 1
        next_tok, next_sib = sibling_links(parents)
        want = logits.argmax(-1).view(bs, n)
        for b in range(bs - 1):  # the last row is unconstrained
            want[b] = full_mask_choice(matchers[b], next_tok[b], next_sib[b], tokens[b],
                                       logits[b * n:(b + 1) * n], vocab)[0]
        before = [allowed_ids(m, vocab) for m in matchers]
        walks = [PathWalk(matchers[b], next_tok[b].tolist(), next_sib[b].tolist(),
                          tokens[b].tolist()) for b in range(bs - 1)]
        got, stats = follow_paths(logits, logits.argmax(-1).view(bs, n), list(range(bs - 1)),
                                  walks, n, vocab, top_k=top_k)
        depth = int(depths.max())
        ref, mine = (accept_tree(tokens, parents, depths, c, depth) for c in (want, got))
        assert torch.equal(committed_tokens(tokens, ref), committed_tokens(tokens, mine)), trial
        assert torch.equal(ref.accept_len, mine.accept_len)
        assert [allowed_ids(m, vocab) for m in matchers] == before
        assert stats.masks <= stats.nodes + stats.masks <= (bs - 1) * n
        total_masks += stats.masks
    if top_k == 16:
        assert total_masks < 8 * (bs - 1) * n / 4  # far fewer fills than the trees' nodes


def test_path_walk_restores_the_matcher_when_the_device_step_fails(grammars, monkeypatch):
    from ddtree_sglang.grammar import masks as grammar_masks

    vocab, compiled = grammars
    m = xgr.GrammarMatcher(compiled["regex"], max_rollback_tokens=200)
    first = allowed_ids(m, vocab)
    parents = torch.tensor([-1, 0, 1])
    tokens = torch.tensor([0, first[0], 5])
    next_tok, next_sib = sibling_links(parents.view(1, -1))
    logits = torch.zeros(3, vocab)
    logits[0, first[0]] = 5.0
    logits[1, 5] = 5.0  # a forbidden favourite: node 1 needs a masked-argmax round

    def broken(*args):
        raise RuntimeError("device failed")

    monkeypatch.setattr(grammar_masks, "masked_argmax", broken)
    walk = PathWalk(m, next_tok[0].tolist(), next_sib[0].tolist(), tokens.tolist())
    with pytest.raises(RuntimeError, match="device failed"):
        follow_paths(logits, logits.argmax(-1).view(1, 3), [0], [walk], 3, vocab)
    assert allowed_ids(m, vocab) == first and walk.done


def seeded_draw(logits: torch.Tensor, req_rows, nodes, top_k: int = 5) -> torch.Tensor:
    """One draw per row from the top-k filtered softmax of the row (temperature 0.7), with
    noise that is a function of (request row, node) alone: the same row draws the same token
    whichever way the rows are batched, as seeded sampling does."""
    out = []
    for row, r, j in zip(logits, req_rows, nodes):
        gen = torch.Generator().manual_seed(1000 * int(r) + int(j))
        kept = row.topk(top_k)  # the filter acts on the masked distribution
        u = torch.rand(top_k, generator=gen).clamp_min(1e-9)
        scores = torch.log_softmax(kept.values / 0.7, -1) - torch.log(-torch.log(u))
        out.append(kept.indices[scores.argmax()])
    return torch.stack(out)


@pytest.mark.parametrize("kind", ["json", "regex", "ebnf"])
def test_sampled_path_masks_commit_what_tree_masks_commit(grammars, kind):
    """Sampling with a mask per visited node (sample_paths) draws every visited node's token
    from the same masked, filtered distribution as with a mask per tree node, so the same
    seeded draws commit the same tokens; the visited rows are left masked (logprobs)."""
    from ddtree_sglang.grammar.masks import sample_paths

    vocab, compiled = grammars
    fills = 0
    for trial, matcher, parents, tokens, paths, logits in random_cases(compiled[kind], vocab,
                                                                        23, 10, 24):
        n = len(tokens)
        first, nxt = sibling_links(parents.view(1, -1))
        depths = torch.tensor([len(p) for p in paths]).view(1, -1)
        # tree masks: every node masked, every node drawn
        mask = allow_all(n, vocab)
        fill_tree_masks(matcher, first[0], nxt[0], tokens, mask)
        masked = logits.masked_fill(~unpack_bitmask(mask, vocab), float("-inf"))
        want = seeded_draw(masked, [0] * n, range(n)).view(1, -1)
        ref = accept_tree(tokens.view(1, -1), parents.view(1, -1), depths, want, 8)
        # path masks: only the nodes the walk visits
        walk = PathWalk(matcher, first[0].tolist(), nxt[0].tolist(), tokens.tolist())
        rows = logits.clone()
        rounds = sample_paths(rows, [0], [walk], n, vocab,
                              lambda sub, r, j: seeded_draw(sub, r, j))
        got = torch.tensor([[walk.choices.get(j, -1) for j in range(n)]])
        mine = accept_tree(tokens.view(1, -1), parents.view(1, -1), depths, got, 8)
        assert torch.equal(committed_tokens(tokens.view(1, -1), ref),
                           committed_tokens(tokens.view(1, -1), mine)), trial
        visited = sorted(walk.choices)
        assert rounds == len(visited) and walk.done and walk.advanced == 0
        assert torch.equal(rows[visited], masked[visited])  # visited rows hold masked logits
        fills += rounds
        # the matcher is back at the root: its mask equals the tree's root row
        root = allow_all(1, vocab)
        matcher.fill_next_token_bitmask(root, 0)
        assert torch.equal(root[0], mask[0])
    assert fills < 10 * 24 / 2  # far fewer masks than tree nodes
