"""A constrained request in the reference loop: its grammar's mask at every tree node, the
tokens it commits, and (opt-in) the forced spine at the root (grammar/forcing.py).

Plain masked decoding chooses each token as the target's choice under the grammar's mask at
its prefix; the loop does the same at every tree node (the row of node c is the mask after the
path to c, by xgrammar's native traversal, grammar.masks.fill_tree_masks), so its greedy output
is plain masked greedy decoding's, whatever tree was verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ddtree_sglang.grammar.forcing import SpineStats, forced_tokens
from ddtree_sglang.grammar.masks import allow_all, fill_tree_masks, unpack_bitmask


@dataclass
class ConstrainedRequest:
    """matcher: the request's grammar matcher (xgrammar.GrammarMatcher) at the prompt's end;
    vocab: the target's vocabulary size; encode: the target's tokenizer (str -> ids), needed
    with `force`, which puts the grammar's forced continuation at the root of every tree;
    `force_children`: a node after which the grammar admits one token has it as its only
    child (grammar.forcing.forced_child_tree)."""

    matcher: Any
    vocab: int
    encode: Callable[[str], list[int]] | None = None
    force: bool = False
    force_children: bool = False
    stats: SpineStats = field(default_factory=SpineStats)

    def __post_init__(self) -> None:
        if self.force and self.encode is None:
            raise ValueError("force needs encode: the forced string is tokenized as the target "
                             "would emit it")

    def spine(self, depth: int) -> list[int]:
        """This step's forced spine (empty unless `force`)."""
        if not self.force:
            return []
        return forced_tokens(self.matcher, self.encode, depth)

    def forced_after(self, prefix: tuple[int, ...]) -> int | None:
        """The one token the grammar admits after the committed tokens and `prefix`, or None
        (several, or a prefix the grammar refuses); the matcher is left where it was."""
        taken = 0
        for t in prefix:
            if not self.matcher.accept_token(t):
                break
            taken += 1
        only = None
        if taken == len(prefix) and not self.matcher.is_terminated():
            allowed = self.allowed_next("cpu")[0].nonzero().view(-1)
            only = int(allowed[0]) if allowed.numel() == 1 else None
        if taken:
            self.matcher.rollback(taken)
        return only

    def allowed_next(self, device) -> torch.Tensor:
        """[1, V] bool: the tokens the grammar allows after the committed ones."""
        mask = allow_all(1, self.vocab)
        self.matcher.fill_next_token_bitmask(mask, 0)
        return unpack_bitmask(mask, self.vocab).to(device)

    def node_masks(self, next_token: torch.Tensor, next_sibling: torch.Tensor,
                   tokens: torch.Tensor) -> torch.Tensor:
        """[n, V] bool: the grammar's allowed tokens after each node of one tree (root first,
        first-child / next-sibling links), as plain decoding's mask at that node's prefix."""
        bitmask = allow_all(tokens.numel(), self.vocab)
        fill_tree_masks(self.matcher, next_token.cpu(), next_sibling.cpu(), tokens.cpu(), bitmask)
        return unpack_bitmask(bitmask, self.vocab).to(tokens.device)

    def commit(self, tokens: list[int]) -> int:
        """The grammar accepts the committed tokens; returns how many the request keeps: all,
        or through the token that ended the grammar (its stop token: the request ends there,
        as plain decoding's does)."""
        for i, t in enumerate(tokens):
            if not self.matcher.accept_token(t):
                raise RuntimeError(f"token {t} was committed but the grammar refuses it")
            if self.matcher.is_terminated():
                return i + 1
        return len(tokens)

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_terminated())
