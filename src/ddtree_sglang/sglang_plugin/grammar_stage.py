"""Structured output in a DDTREE decode step: which constrained request gets which masks, the
tree masks built while the verify pass runs, and the greedy path walk after it
(ddtree_sglang.grammar.masks holds the algorithm and why it is exact).

SGLANG_DDTREE_GRAMMAR picks the method (settings.GRAMMAR_METHODS):
  tree    every constrained request's node masks by xgrammar's native traversal;
  path    greedy requests without logprobs walk their accepted path, the others as `tree`;
  auto    per request and step: a greedy request walks its path where its tree masks cost the
          host more than WALK_ABOVE_US at its last masked step, else it gets tree masks.
Why `auto`: tree masks are filled while the verify pass runs, so cheap ones (most JSON and regex
states, ~20-150 us per request) cost the step nothing, whereas the walk runs after the verify
and reads the top-K back; a bounded repetition (maxLength, {m,n}) makes one fill cost up to
milliseconds and every tree node pays it, so there the walk wins by far.  A walking request's
evidence decays (x DECAY per step) so that it retries tree masks once its grammar may have
left the costly state.  Tree masks of costly requests are filled on a few threads (xgrammar
releases the GIL); cheap ones serially, where a thread hand-off costs more than the fill.
Requests whose grammar is not xgrammar's (llguidance, outlines, a reasoning wrapper) always
take SGLang's traversal: their objects expose no native matcher.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ddtree_sglang.grammar.masks import (PathWalk, allow_all, fill_tree_masks,
                                         follow_paths, follow_sampled_paths)
from ddtree_sglang.grammar.forcing import forced_rows, forced_tokens
from ddtree_sglang.sglang_plugin import patches, sglang_api as sg

WALK_ABOVE_US = 100.0  # auto: host us of one request's tree masks above which it walks
THREAD_ABOVE_US = 200.0  # tree masks this costly go to the thread pool
DECAY = 0.9
THREADS = 4


@dataclass
class MaskCosts:
    """Per request (by rid): the host microseconds its tree masks took at its last masked step,
    decaying while it walks, and its path walk at its last walked step; the evidence `auto`
    and the thread pool decide by."""

    us: dict[str, float] = field(default_factory=dict)
    walk_us: dict[str, float] = field(default_factory=dict)
    pool: ThreadPoolExecutor | None = None

    def estimate(self, rid: str) -> float:
        return self.us.get(rid, 0.0)

    def walked(self, rid: str) -> None:
        self.us[rid] = self.us.get(rid, 0.0) * DECAY

    def walk_is_cheaper(self, rid: str) -> bool:
        """Whether walking beats tree masks for this request: its tree masks cost more than
        WALK_ABOVE_US a step and its last walk (if any) cost less than them."""
        tree = self.estimate(rid)
        return tree > WALK_ABOVE_US and self.walk_us.get(rid, 0.0) < tree

    def keep_only(self, rids: set[str]) -> None:
        """Forget finished requests."""
        if len(self.us) > len(rids):
            self.us = {r: v for r, v in self.us.items() if r in rids}
        if len(self.walk_us) > len(rids):
            self.walk_us = {r: v for r, v in self.walk_us.items() if r in rids}

    def threads(self) -> ThreadPoolExecutor:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(THREADS, thread_name_prefix="ddtree-grammar")
        return self.pool


@dataclass(frozen=True)
class Walks:
    """The requests of a step that walk their accepted path one way: their batch rows, one
    PathWalk each, and their rids (whose walk costs `record` keeps)."""

    rows: tuple[int, ...] = ()
    walks: tuple[PathWalk, ...] = ()
    rids: tuple[str, ...] = ()

    def add(self, row: int, walk: PathWalk, rid: str) -> "Walks":
        return Walks(self.rows + (row,), self.walks + (walk,), self.rids + (rid,))

    def record(self, costs: MaskCosts | None) -> None:
        """Each walk's host time, the evidence `auto` weighs against tree masks."""
        if costs is not None:
            for rid, walk in zip(self.rids, self.walks):
                costs.walk_us[rid] = walk.host_s * 1e6


@dataclass(frozen=True)
class GrammarStep:
    """The grammar's part of one decode step.

    mask: SGLang's GrammarMask over every node ([bs * n] rows; rows of walked and
        unconstrained requests allow all), None when no request needs one.
    greedy: the requests that walk by the target's top-K (grammar.masks.follow_paths);
    sampled: those that walk with a mask per visited node (grammar.masks.sample_paths).
    """

    mask: Any | None
    greedy: Walks = Walks()
    sampled: Walks = Walks()


def native_matcher(req) -> Any | None:
    """The request's xgrammar matcher, or None where its grammar object is another kind."""
    grammar = req.grammar
    return grammar.matcher if type(grammar) is sg.XGrammarGrammar else None


def walks_greedily(req) -> bool:
    """A greedy request (SGLang turns temperature 0 into top_k 1) that wants no logprobs: its
    choice at a node needs no mask where the target's own ranking settles it."""
    return req.sampling_params.top_k == 1 and not req.return_logprob


def walks_here(req, matcher, method: str, costs: MaskCosts) -> bool:
    """Whether this request walks its accepted path this step (see the module docstring):
    greedily by the target's top-K (walks_greedily), or else with a mask per visited node."""
    if matcher is None:
        return False
    return method == "path" or (method == "auto" and costs.walk_is_cheaper(req.rid))


def build_grammar_step(reqs: list, links: tuple[torch.Tensor, ...], width: int, vocab: int,
                       device, method: str, costs: MaskCosts) -> GrammarStep | None:
    """After the verify launch (and the grammar barrier): the masks of the requests that need
    them, and a walk for each greedy one.  links: the host copies of the tree's first-child,
    next-sibling and token arrays, [bs, width] each."""
    next_token, next_sibling, tokens = links
    walked = {True: Walks(), False: Walks()}  # walks greedily? -> its walks
    masked = []
    for i, req in enumerate(reqs):
        if req.grammar is None:
            continue
        matcher = native_matcher(req)
        if walks_here(req, matcher, method, costs):
            greedy = walks_greedily(req)
            walked[greedy] = walked[greedy].add(i, PathWalk(
                matcher, next_token[i].tolist(), next_sibling[i].tolist(), tokens[i].tolist()),
                req.rid)
            costs.walked(req.rid)
        else:  # tree masks: natively, or by SGLang's traversal where there is no matcher
            masked.append((i, req, matcher))
    costs.keep_only({r.rid for r in reqs if r.grammar is not None})
    if not masked and not walked[True].walks and not walked[False].walks:
        return None
    mask = None
    if masked:
        bitmask = allow_all(len(reqs) * width, vocab, pin=torch.cuda.is_available())

        def fill(job) -> None:
            i, req, matcher = job
            rows = bitmask[i * width:(i + 1) * width]
            t0 = time.perf_counter()
            if matcher is not None:
                fill_tree_masks(matcher, next_token[i], next_sibling[i], tokens[i], rows)
            else:
                sg.traverse_tree(next_token[i], next_sibling[i], tokens[i], req.grammar, rows,
                                 vocab_size=vocab)
            costs.us[req.rid] = (time.perf_counter() - t0) * 1e6

        costly = [j[2] is not None and costs.estimate(j[1].rid) > THREAD_ABOVE_US
                  for j in masked]
        on_threads = sum(costly) > 1
        futures = [costs.threads().submit(fill, job) for job, c in zip(masked, costly)
                   if c and on_threads]
        for job, c in zip(masked, costly):  # the cheap ones here meanwhile
            if not (c and on_threads):
                fill(job)
        for f in futures:
            f.result()
        mask = sg.GrammarMask(masked[0][1].grammar, bitmask.to(device, non_blocking=True))
    return GrammarStep(mask=mask, greedy=walked[True], sampled=walked[False])


def grammar_choices(step: GrammarStep | None, logits: torch.Tensor, choice: torch.Tensor,
                    width: int, vocab: int,
                    costs: MaskCosts | None = None) -> torch.Tensor:
    """The device's choices [bs, width] with each walked request's path replaced by its
    grammar's greedy choice (processed logits [bs * width, V], unmasked on walked rows); each
    walk's host time goes to `costs`."""
    if step is None or not step.greedy.walks:
        return choice
    out, _ = follow_paths(logits, choice, step.greedy.rows, step.greedy.walks, width, vocab)
    step.greedy.record(costs)
    return out


def sampled_grammar_choices(step: GrammarStep | None, logits: torch.Tensor,
                            choice: torch.Tensor, width: int, vocab: int, sample,
                            costs: MaskCosts | None = None) -> torch.Tensor:
    """The choices [bs, width] with each sampled walk's path nodes drawn under their masks
    (grammar.masks.sample_paths; `sample(rows, req_rows, nodes)` draws one token per masked
    logits row); the visited rows of `logits` are left masked for the logprobs."""
    if step is None or not step.sampled.walks:
        return choice
    out, _ = follow_sampled_paths(logits, choice, step.sampled.rows, step.sampled.walks, width,
                                  vocab, sample)
    step.sampled.record(costs)
    return out


def start_grammar_step(batch, grammar_tree, width: int, barrier: Callable[[], None] | None,
                       device, method: str, costs: MaskCosts) -> GrammarStep | None:
    """Wait for the previous step's tokens to reach the grammars (SGLang's barrier), then build
    this step's masks over the tree's host copy, whose transfer started before the verify."""
    if barrier is not None:
        barrier()
    patches.reset_grammar_mask(batch.sampling_info)
    return build_grammar_step(batch.reqs, grammar_tree.resolve(), width,
                              batch.sampling_info.vocab_size, device, method, costs)


def grammar_spines(reqs: list, depth: int, device) -> torch.Tensor:
    """[bs, depth] the forced spine of each request (grammar.forcing.forced_tokens: what its
    grammar forces from the committed tokens, tokenized by its tokenizer), -1 past it and for
    requests without a native grammar or a tokenizer; on the device, copied without a wait."""
    spines = []
    for req in reqs:
        matcher = native_matcher(req) if req.grammar is not None else None
        tokenizer = req.tokenizer
        spines.append([] if matcher is None or tokenizer is None else forced_tokens(
            matcher, lambda s: tokenizer.encode(s, add_special_tokens=False), depth))
    rows = forced_rows(spines, depth)
    if torch.cuda.is_available():
        rows = rows.pin_memory()
    return rows.to(device, non_blocking=True)
