"""Structured output in a DDTREE decode step: which constrained request gets which masks, the
tree masks built while the verify pass runs, and the greedy path walk after it
(ddtree_sglang.grammar_masks holds the algorithm and why it is exact).

SGLANG_DDTREE_GRAMMAR picks the method:
  tree    every constrained request's node masks by xgrammar's native traversal (the default);
  path    greedy requests without logprobs walk their accepted path, the others as `tree`;
  python  SGLang's own Python traversal over the tree (what DFLASH and EAGLE run).
Requests whose grammar is not xgrammar's (llguidance, outlines, a reasoning wrapper) always
take SGLang's traversal: their objects expose no native matcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ddtree_sglang.grammar_masks import (PathStats, PathWalk, allow_all, fill_tree_masks,
                                         follow_paths)
from ddtree_sglang.sglang_plugin import contract

GRAMMAR_METHODS = ("tree", "path", "python")


@dataclass(frozen=True)
class GrammarStep:
    """The grammar's part of one decode step.

    mask: SGLang's GrammarMask over every node ([bs * n] rows; rows of walked and
        unconstrained requests allow all), None when no request needs one.
    walks: one PathWalk per walked request, for the rows in `walk_rows`.
    """

    mask: Any | None
    walk_rows: tuple[int, ...]
    walks: tuple[PathWalk, ...]


def native_matcher(req) -> Any | None:
    """The request's xgrammar matcher, or None where its grammar object is another kind."""
    grammar = req.grammar
    return grammar.matcher if type(grammar) is contract.XGrammarGrammar else None


def walks_greedily(req) -> bool:
    """A greedy request (SGLang turns temperature 0 into top_k 1) that wants no logprobs: its
    choice at a node needs no mask where the target's own ranking settles it."""
    return req.sampling_params.top_k == 1 and not req.return_logprob


def build_grammar_step(reqs: list, links: tuple[torch.Tensor, ...], width: int, vocab: int,
                       device, method: str) -> GrammarStep | None:
    """After the verify launch (and the grammar barrier): the masks of the requests that need
    them, and a walk for each greedy one.  links: the host copies of the tree's first-child,
    next-sibling and token arrays, [bs, width] each."""
    next_token, next_sibling, tokens = links
    walk_rows, walks, masked = [], [], []
    for i, req in enumerate(reqs):
        if req.grammar is None:
            continue
        matcher = native_matcher(req)
        if method == "path" and matcher is not None and walks_greedily(req):
            walk_rows.append(i)
            walks.append(PathWalk(matcher, next_token[i].tolist(), next_sibling[i].tolist(),
                                  tokens[i].tolist()))
        else:
            masked.append((i, req, matcher))
    if not masked and not walks:
        return None
    mask = None
    if masked:
        bitmask = allow_all(len(reqs) * width, vocab, pin=torch.cuda.is_available())
        for i, req, matcher in masked:
            rows = bitmask[i * width:(i + 1) * width]
            if matcher is not None and method != "python":
                fill_tree_masks(matcher, next_token[i], next_sibling[i], tokens[i], rows)
            else:
                contract.traverse_tree(next_token[i], next_sibling[i], tokens[i], req.grammar,
                                       rows, vocab_size=vocab)
        mask = contract.GrammarMask(masked[0][1].grammar, bitmask.to(device, non_blocking=True))
    return GrammarStep(mask=mask, walk_rows=tuple(walk_rows), walks=tuple(walks))


def grammar_choices(step: GrammarStep | None, logits: torch.Tensor, choice: torch.Tensor,
                    width: int, vocab: int) -> tuple[torch.Tensor, PathStats | None]:
    """The device's choices [bs, width] with each walked request's path replaced by its
    grammar's greedy choice (processed logits [bs * width, V], unmasked on walked rows)."""
    if step is None or not step.walks:
        return choice, None
    return follow_paths(logits, choice, step.walk_rows, step.walks, width, vocab)


def start_grammar_step(batch, grammar_tree, width: int, barrier: Callable[[], None] | None,
                       device, method: str) -> GrammarStep | None:
    """Wait for the previous step's tokens to reach the grammars (SGLang's barrier), then build
    this step's masks over the tree's host copy, whose transfer started before the verify."""
    if barrier is not None:
        barrier()
    batch.sampling_info.grammar_mask = None  # else the prefill's leftover mask is applied
    return build_grammar_step(batch.reqs, grammar_tree.resolve(), width,
                              batch.sampling_info.vocab_size, device, method)

