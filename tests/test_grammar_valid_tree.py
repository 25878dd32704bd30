"""grammar_tree (a draft tree the grammar allows) with real xgrammar grammars on the testbed's
tokenizer: validity equals the grammar's verdict on each node's whole path, the selection is
the best valid prefix-closed subset, its layout equals one built from scratch, and verifying
it commits what masked greedy decoding commits, never less than the unpruned tree."""
import random

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from ddtree_sglang.tree.acceptance import accept_tree, committed_tokens  # noqa: E402
from ddtree_sglang.tree.draft_tree import DraftTree  # noqa: E402
from ddtree_sglang.grammar.masks import allow_all, fill_tree_masks, masked_argmax  # noqa: E402
from ddtree_sglang.grammar.valid_tree import select_layout, select_nodes, valid_nodes  # noqa: E402
from ddtree_sglang.tree.verify_layout import build_verify_layout, truncate_layout  # noqa: E402

from test_grammar_masks import grammars, random_cases, random_tree  # noqa: E402,F401

KINDS = ["json", "regex", "ebnf"]


def path_accepted(matcher, path: list[int]) -> bool:
    taken = 0
    for t in path:
        if matcher.is_terminated() or not matcher.accept_token(t):
            break
        taken += 1
    if taken:
        matcher.rollback(taken)
    return taken == len(path)


def layout_of(parents: list[int], tokens: list[int]):
    """The verify layout of one tree given over tree indices (root 0, parent -1)."""
    nodes = torch.tensor(parents[1:]).view(1, -1) - 1  # node parents: -1 = the root
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    tree = DraftTree(tokens=torch.tensor(tokens[1:]).view(1, -1), parents=nodes,
                     depths=torch.tensor(depth[1:]).view(1, -1),
                     scores=torch.zeros(1, len(parents) - 1))
    return build_verify_layout(tree, torch.tensor([tokens[0]]), torch.tensor([5]))


@pytest.mark.parametrize("kind", KINDS)
def test_a_node_is_valid_exactly_when_the_grammar_accepts_its_path(grammars, kind):
    vocab, compiled = grammars
    rng = random.Random(3)
    for trial in range(6):
        matcher = xgr.GrammarMatcher(compiled[kind])
        parents, tokens, paths = random_tree(matcher, vocab, 28, rng)
        valid = valid_nodes(matcher, parents.tolist(), tokens.tolist())
        assert valid == [path_accepted(matcher, p) for p in paths], trial
        assert 0 < sum(valid) < len(valid)  # the trees mix both kinds
        # the matcher is back where it started: the root's mask is unchanged
        before, after = allow_all(1, vocab), allow_all(1, vocab)
        fresh = xgr.GrammarMatcher(compiled[kind])
        fresh.fill_next_token_bitmask(before, 0)
        matcher.fill_next_token_bitmask(after, 0)
        assert torch.equal(before, after)


def test_the_selection_is_the_best_valid_prefix_closed_subset():
    rng = random.Random(5)
    for _ in range(200):
        n = rng.randrange(2, 30)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        valid = [True] + [False] * (n - 1)
        for i in range(1, n):
            valid[i] = valid[parents[i]] and rng.random() < 0.7
        width = rng.randrange(1, n + 1)
        keep = select_nodes(parents, valid, width)
        assert len(keep) == width and keep == sorted(keep) and keep[0] == 0
        assert all(parents[i] in keep for i in keep[1:])  # prefix-closed
        best_valid = [i for i in range(n) if valid[i]][:width]
        assert [i for i in keep if valid[i]] == best_valid
    with pytest.raises(ValueError, match="width must be in 1..3"):
        select_nodes([-1, 0, 0], [True] * 3, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_the_selected_layout_equals_one_built_from_the_subset(grammars, kind):
    vocab, compiled = grammars
    rng = random.Random(11)
    matcher = xgr.GrammarMatcher(compiled[kind])
    parents, tokens, _ = random_tree(matcher, vocab, 20, rng)
    parents, tokens = parents.tolist(), tokens.tolist()
    keep = select_nodes(parents, valid_nodes(matcher, parents, tokens), 9)
    got = select_layout(layout_of(parents, tokens), torch.tensor([keep]))
    index = {old: new for new, old in enumerate(keep)}
    want = layout_of([-1] + [index[parents[i]] for i in keep[1:]], [tokens[i] for i in keep])
    for name, value in vars(want).items():
        assert torch.equal(getattr(got, name), value), name


@pytest.mark.parametrize("kind", KINDS)
def test_verifying_the_valid_tree_commits_masked_greedy_decoding_and_never_less(grammars, kind):
    """The target's logits are a function of the node's path (as a real target's are), so a
    node kept by both trees gets the same choice; the valid tree keeps every valid node of the
    unpruned one, hence commits the same masked-greedy tokens, at least as many."""
    vocab, compiled = grammars
    longer = 0
    for trial, matcher, parents, tokens, paths, logits in random_cases(compiled[kind], vocab,
                                                                        17, 12, 30):
        logits_by_path = dict(zip(map(tuple, paths), logits))
        parents, tokens = parents.tolist(), tokens.tolist()
        width = 10
        full = layout_of(parents, tokens)
        keep = select_nodes(parents, valid_nodes(matcher, parents, tokens), width)
        commits = []
        for lay, nodes in ((truncate_layout(full, width), list(range(width))),
                           (select_layout(full, torch.tensor([keep])), keep)):
            toks = lay.draft_tokens.view(1, -1)
            mask = allow_all(width, vocab)
            fill_tree_masks(matcher, lay.retrieve_next_token[0], lay.retrieve_next_sibling[0],
                            toks[0], mask)
            logits = torch.stack([logits_by_path[tuple(paths[i])] for i in nodes])
            choice = masked_argmax(logits, mask).view(1, -1)
            acc = accept_tree(toks, lay.tree_parents, lay.tree_depths, choice, 8)
            out = committed_tokens(toks, acc)[0]
            commits.append(out[: int(acc.accept_len[0])].tolist())
        plain, valid = commits
        assert valid[: len(plain)] == plain, trial  # the same tokens, then possibly more
        assert path_accepted(matcher, valid), trial  # every committed token obeys the grammar
        longer += len(valid) > len(plain)
    assert longer > 0  # pruning made room for a longer accepted path somewhere
