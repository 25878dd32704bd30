"""Structured output over a draft tree: the grammar's say at every node the acceptance walk
can reach, at host cost that follows the accepted path rather than the tree.

A constrained request's choice at a tree node is the target's choice under that node's grammar
mask (plain decoding's rule, applied at the node's prefix).  Two ways to get it:

* **Tree masks** (`fill_tree_masks`): one bitmask per node, filled by xgrammar's native
  depth-first traversal (`GrammarMatcher.traverse_draft_tree`, C++), for every request that
  needs the masked distribution itself (sampling, logprobs).  Same rows as SGLang's Python
  traversal (`spec_utils.traverse_tree`): a node whose token its parent's mask forbids gets no
  mask and no descendants; a node where the grammar has terminated allows everything.

* **Path masks** (`follow_paths`) for greedy requests.  The acceptance walk needs the choice at
  the nodes it visits only, and under greedy decoding the choice needs no mask where the
  target's own ranking settles it:

      Let v be a node's processed logits (penalties, logit bias: everything but the grammar),
      M the grammar's allowed set there, and the choice argmax over M of v, ties to the lowest
      id (torch.argmax).  Take the K best tokens in the order (-v, id) and the K-th value vK.
      The first of them that the grammar accepts, c, is the choice if v[c] > vK: every token
      ranked above c in the whole vocabulary has v >= v[c] > vK, so it is among the K and was
      rejected, or it ties c with a higher id.  Masking only sets forbidden logits to -inf and
      penalties act token-wise, so the two commute and the result is the masked argmax.

  So a node costs one `accept_token` + `rollback` per candidate tried (microseconds); a mask is
  filled only where no candidate above vK is allowed (the target prefers what the grammar
  forbids), and its masked argmax is then taken on the device (`masked_argmax`), one round
  for all such nodes of the batch.  Nodes off the accepted path cost nothing.

  The top-K shortcut does not carry over to sampling: with top-k / top-p / min-p the filter
  acts on the masked distribution, whose support depends on the mask over the whole
  vocabulary, and a draw from the unmasked distribution kept only when allowed is not a draw
  with the same random numbers as plain decoding's.  What does carry over is following the
  path: **sampled path masks** (`sample_paths`) fill a mask at each node the acceptance walk
  visits, apply it to that node's logits and draw there, round by round (one read-back per
  depth reached).  A visited node's draw comes from the same masked, filtered distribution as
  with tree masks, and no other node's choice is read, so the commit is the same; the visited
  rows keep their masked logits, which is where logprobs are read.  Masks filled per step:
  the accepted path's length + 1 instead of the tree's B + 1.

The host work here needs the target's ranking, so a step with greedy constrained requests reads
the verify's top-K back to the host once (plus once per fallback round), after the verify pass,
whereas tree masks are filled while it runs (sglang_plugin/grammar_stage.py chooses between
them per request).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

TOP_K = 16  # candidates per node read back for the greedy walk


class Matcher(Protocol):
    """The grammar-matcher calls used here (xgrammar.GrammarMatcher has them)."""

    def accept_token(self, token_id: int) -> bool: ...
    def rollback(self, num_tokens: int = 1) -> None: ...
    def is_terminated(self) -> bool: ...
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> bool: ...
    def traverse_draft_tree(self, retrieve_next_token: torch.Tensor,
                            retrieve_next_sibling: torch.Tensor, draft_tokens: torch.Tensor,
                            token_bitmask: torch.Tensor) -> bool: ...


def bitmask_words(vocab: int) -> int:
    """int32 words per bitmask row (xgrammar's layout: bit t % 32 of word t // 32)."""
    return (vocab + 31) // 32


def allow_all(rows: int, vocab: int, pin: bool = False) -> torch.Tensor:
    """[rows, words] int32 bitmask allowing every token."""
    return torch.full((rows, bitmask_words(vocab)), -1, dtype=torch.int32,
                      pin_memory=pin and torch.cuda.is_available())


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab] bool (True: allowed)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """[rows] argmax of [rows, V] logits over the tokens the [rows, words] bitmask allows
    (ties to the lowest id, as torch.argmax)."""
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
    return logits.masked_fill(~allowed, float("-inf")).argmax(dim=-1)


def fill_tree_masks(matcher: Matcher, next_token: torch.Tensor, next_sibling: torch.Tensor,
                    tokens: torch.Tensor, bitmask: torch.Tensor) -> None:
    """One request's node masks ([n, words] rows of `bitmask`, host int32) by xgrammar's native
    traversal of the tree given as first-child / next-sibling links over its n nodes.

    xgrammar leaves an empty row where SGLang's traversal leaves the row allowing all: at a
    node whose token the grammar forbids (acceptance never reaches it) and at a node where the
    grammar has terminated (after its stop token, where plain decoding stops masking).  Such
    rows are set to allow all, so the rows equal SGLang's and no row is all -inf."""
    matcher.traverse_draft_tree(next_token, next_sibling, tokens, bitmask)
    empty = (bitmask == 0).all(dim=1)
    bitmask[empty] = -1


@dataclass
class PathWalk:
    """One greedy request's walk down its tree under its grammar, resumable after a round of
    masked argmaxes.  The matcher is advanced along the path and rolled back when done."""

    matcher: Matcher
    first_child: Sequence[int]
    next_sibling: Sequence[int]
    tokens: Sequence[int]
    node: int = 0
    advanced: int = 0  # tokens accepted into the matcher so far
    choices: dict[int, int] = field(default_factory=dict)
    done: bool = False
    host_s: float = 0.0  # host seconds of this walk's grammar work (checks and mask fills)

    def child(self, node: int, token: int) -> int:
        c = self.first_child[node]
        while c != -1 and self.tokens[c] != token:
            c = self.next_sibling[c]
        return c

    def step(self, top_values: Sequence[float], top_ids: Sequence[int], device_choice: int,
             vocab_complete: bool) -> int | None:
        """Decide the current node's choice and move; returns None when it moved or ended,
        or the node whose mask the caller must fill and argmax (the matcher stays there)."""
        node = self.node
        if node in self.choices:
            choice = self.choices[node]
        elif self.matcher.is_terminated():  # terminated: everything allowed
            choice = device_choice
        else:
            found = first_allowed(self.matcher, top_values, top_ids, vocab_complete)
            if found is None:
                return node
            choice = found
        self.move(choice)
        return None

    def move(self, choice: int) -> None:
        """Record the current node's choice (one its grammar allows) and go to the child that
        holds it, advancing the grammar, or end the walk where no child does."""
        node = self.node
        self.choices[node] = choice
        nxt = self.child(node, choice)
        if nxt == -1:
            self.finish()
            return
        if not self.matcher.is_terminated():
            if not self.matcher.accept_token(choice):  # the choice was allowed: cannot happen
                self.finish()
                raise RuntimeError(f"grammar refused token {choice}, its own masked choice")
            self.advanced += 1
        self.node = nxt

    def finish(self) -> None:
        if self.advanced:
            self.matcher.rollback(self.advanced)
        self.advanced, self.done = 0, True


def first_allowed(matcher: Matcher, values: Sequence[float], ids: Sequence[int],
                  vocab_complete: bool = False) -> int | None:
    """The masked argmax from a node's top-K (ids with their values), or None when the top-K
    does not settle it (see the module docstring).  `vocab_complete`: the K cover the whole
    vocabulary, so no token lies below the K-th value."""
    order = sorted(range(len(ids)), key=lambda j: (-values[j], ids[j]))
    boundary = values[order[-1]]
    for j in order:
        if not vocab_complete and values[j] <= boundary:
            return None
        if matcher.accept_token(ids[j]):
            matcher.rollback(1)
            return ids[j]
    return None


@dataclass(frozen=True)
class PathStats:
    """What the walks cost: nodes decided, masks filled, fallback rounds."""

    nodes: int
    masks: int
    rounds: int


def follow_paths(logits: torch.Tensor, device_choice: torch.Tensor, rows: Sequence[int],
                 walks: Sequence[PathWalk], width: int, vocab: int,
                 top_k: int = TOP_K) -> tuple[torch.Tensor, PathStats]:
    """Greedy choices along each walked request's accepted path.

    logits [bs * width, V]: processed, unmasked node logits; device_choice [bs, width]: the
    device's choice (kept where no walk decides); rows: the batch rows walked, one PathWalk
    each.  Returns the choices with every walked row's path nodes replaced by its grammar's
    masked argmax, and the cost."""
    if not rows:
        return device_choice, PathStats(0, 0, 0)
    dev = logits.device
    row_t = torch.tensor(rows, dtype=torch.long, device=dev)
    node_rows = (row_t.view(-1, 1) * width + torch.arange(width, device=dev)).view(-1)
    sub = logits.index_select(0, node_rows)[:, :vocab]
    k = min(top_k, sub.shape[-1])
    top = sub.topk(k, dim=-1)
    values = top.values.float().view(len(rows), width, k).cpu().tolist()
    ids = top.indices.view(len(rows), width, k).cpu().tolist()
    dev_choice = device_choice.index_select(0, row_t).cpu().tolist()
    complete = k >= vocab
    try:
        nodes, masks, rounds = walk_paths(logits, rows, walks, width, vocab, values, ids,
                                         dev_choice, complete)
    finally:  # every matcher back where the step found it, also on an error
        for walk in walks:
            if not walk.done:
                walk.finish()
    return with_walk_choices(device_choice, rows, walks), PathStats(nodes, masks, rounds)


def with_walk_choices(device_choice: torch.Tensor, rows: Sequence[int],
                      walks: Sequence[PathWalk]) -> torch.Tensor:
    """device_choice [bs, width] with each walked row's decided nodes (walk.choices) set to
    the walk's choices; every other entry as it was."""
    decided = [(r, j, c) for r, walk in zip(rows, walks) for j, c in walk.choices.items()]
    out = device_choice.clone()
    if decided:
        row, node, choice = torch.tensor(decided, dtype=torch.long, device=out.device).T
        out[row, node] = choice.to(out.dtype)
    return out


def follow_sampled_paths(logits: torch.Tensor, device_choice: torch.Tensor,
                         rows: Sequence[int], walks: Sequence[PathWalk], width: int, vocab: int,
                         sample: Callable) -> tuple[torch.Tensor, int]:
    """The choices [bs, width] with each walked row's path nodes drawn under their masks
    (sample_paths), and the rounds it took; every matcher is back where it was after."""
    try:
        rounds = sample_paths(logits, rows, walks, width, vocab, sample)
    finally:  # also on an error
        for walk in walks:
            if not walk.done:
                walk.finish()
    return with_walk_choices(device_choice, rows, walks), rounds


def walk_paths(logits: torch.Tensor, rows: Sequence[int], walks: Sequence[PathWalk], width: int,
              vocab: int, values: list, ids: list, dev_choice: list,
              complete: bool) -> tuple[int, int, int]:
    """Run every walk to its end: top-K decisions, then rounds of masked argmaxes for the
    nodes the top-K did not settle.  Returns (nodes decided, masks filled, rounds)."""
    dev = logits.device
    nodes = masks = rounds = 0
    pending = list(range(len(walks)))
    while pending:
        needs: list[tuple[int, int]] = []
        for w in pending:
            walk = walks[w]
            started = time.perf_counter()
            while not walk.done:
                node = walk.node
                stop = walk.step(values[w][node], ids[w][node], dev_choice[w][node], complete)
                nodes += stop is None
                if stop is not None:
                    needs.append((w, stop))
                    break
            walk.host_s += time.perf_counter() - started
        if not needs:
            break
        rounds += 1
        masks += len(needs)
        bitmask = allow_all(len(needs), vocab, pin=dev.type == "cuda")
        for i, (w, node) in enumerate(needs):
            started = time.perf_counter()
            walks[w].matcher.fill_next_token_bitmask(bitmask, i)
            walks[w].host_s += time.perf_counter() - started
        picked = torch.tensor([rows[w] * width + node for w, node in needs], dtype=torch.long,
                              device=dev)
        chosen = masked_argmax(logits.index_select(0, picked)[:, :vocab],
                               bitmask.to(dev, non_blocking=True)).cpu().tolist()
        for (w, node), c in zip(needs, chosen):
            walks[w].choices[node] = c
        pending = [w for w, _ in needs]
    return nodes, masks, rounds


def sample_paths(logits: torch.Tensor, rows: Sequence[int], walks: Sequence[PathWalk],
                 width: int, vocab: int,
                 sample: Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]) -> int:
    """Choices along each walked request's accepted path for requests that need the masked
    distribution itself (sampling, top-k / top-p / min-p, logprobs): a mask per visited node
    instead of one per tree node.

    Round by round, every unfinished walk's current node gets its grammar mask (host), which
    is applied in place to that node's row of `logits` [bs * width, V] (processed: penalties,
    logit bias), and `sample(masked rows, their requests' batch rows, their nodes)` draws the
    target's choice there; the walk moves to the child holding it.  Exact: a visited node's
    choice is drawn from the same masked, filtered distribution as with tree masks, and the
    acceptance walk reads no other node's choice; the rows of visited nodes hold the masked
    logits that the committed tokens' logprobs are read from.  Each round reads its draws
    back (one wait per depth the walks reach).  Returns the rounds; each walk's choices are
    in `walk.choices`, its host time in `walk.host_s`."""
    dev = logits.device
    pending = [w for w, walk in enumerate(walks) if not walk.done]
    rounds = 0
    while pending:
        bitmask = allow_all(len(pending), vocab, pin=dev.type == "cuda")
        for i, w in enumerate(pending):
            walk = walks[w]
            started = time.perf_counter()
            if not walk.matcher.is_terminated():  # terminated: everything allowed
                walk.matcher.fill_next_token_bitmask(bitmask, i)
            walk.host_s += time.perf_counter() - started
        req_rows = [rows[w] for w in pending]
        nodes = [walks[w].node for w in pending]
        picked = torch.tensor([r * width + j for r, j in zip(req_rows, nodes)],
                              dtype=torch.long, device=dev)
        allowed = unpack_bitmask(bitmask.to(dev, non_blocking=True), vocab)
        sub = logits.index_select(0, picked)
        sub[:, :vocab] = sub[:, :vocab].masked_fill(~allowed, float("-inf"))
        logits.index_copy_(0, picked, sub)
        chosen = sample(sub, req_rows, nodes).tolist()
        for w, c in zip(pending, chosen):
            walks[w].move(int(c))
        pending = [w for w in pending if not walks[w].done]
        rounds += 1
    return rounds
