"""Exact per-node sampling penalties for a verified draft tree.

SGLang's penalizers (frequency, presence, repetition, min_new_tokens) depend on the tokens a
request has generated so far.  In a tree verify every node has its own history: the request's
output so far plus the draft tokens on the node's path.  Reusing the request's penalties for
every node (what SGLang's linear DFlash / EAGLE verify does, "a relaxed version") changes the
output.  Here each node gets exactly what plain decoding would apply at that point:

    add   = -frequency * count(v) - presence * [count(v) > 0]
            + (-inf for stop tokens while out_len + depth < min_new_tokens)
    logit = logit + add;  logit = logit * r if logit < 0 else logit / r,
            r = repetition if count(v) > 0 else 1

(SGLang's order: additive penalties, then the scaling one), with count = the request's output
counts plus the node's path.  The part shared by all nodes of a request is applied densely; the
few columns a node's path or the stop set touches are recomputed from the original logits and
written over, so no [rows, V] per-node penalty tensor is materialised.  Fixed shapes, no host
sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RequestPenalties:
    """One request's penalty settings (host side; the reference loop's input)."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    min_new_tokens: int = 0
    stop_tokens: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not -2.0 <= self.frequency <= 2.0 or not -2.0 <= self.presence <= 2.0:
            raise ValueError("frequency and presence penalties must be in [-2, 2]")
        if not 0.0 < self.repetition <= 2.0:
            raise ValueError(f"repetition penalty must be in (0, 2], got {self.repetition}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")

    @property
    def active(self) -> bool:
        return (self.frequency != 0.0 or self.presence != 0.0 or self.repetition != 1.0
                or self.min_new_tokens > 0)


@dataclass(frozen=True)
class PenaltyParams:
    """Per-request penalty settings, [bs] each (SGLang's meanings; neutral values: 0, 0, 1, 0).
    stop_tokens [bs, S]: ids that min_new_tokens suppresses, padded with -1 (S may be 0)."""

    frequency: torch.Tensor
    presence: torch.Tensor
    repetition: torch.Tensor
    min_new_tokens: torch.Tensor
    stop_tokens: torch.Tensor

    @classmethod
    def of(cls, reqs: list[RequestPenalties], device) -> "PenaltyParams":
        return cls.from_lists([r.frequency for r in reqs], [r.presence for r in reqs],
                              [r.repetition for r in reqs], [r.min_new_tokens for r in reqs],
                              [r.stop_tokens for r in reqs], device)

    @classmethod
    def from_lists(cls, frequency, presence, repetition, min_new_tokens, stop_tokens,
                   device) -> "PenaltyParams":
        """From per-request host lists (stop_tokens: a list of id collections)."""
        width = max((len(s) for s in stop_tokens), default=0)
        stops = torch.full((len(frequency), width), -1, dtype=torch.long)
        for i, ids in enumerate(stop_tokens):
            if ids:
                stops[i, : len(ids)] = torch.tensor(sorted(ids), dtype=torch.long)

        def dev(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(dev(frequency, torch.float32), dev(presence, torch.float32),
                   dev(repetition, torch.float32), dev(min_new_tokens, torch.int64),
                   stops.to(device, non_blocking=True))


def path_tokens(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                max_depth: int) -> torch.Tensor:
    """[bs, N, max_depth] the draft tokens on each node's path (the node included, the root
    excluded), -1 padded.  tokens/parents/depths [bs, N] over tree indices (root at 0)."""
    bs, n = tokens.shape
    node = torch.arange(n, device=tokens.device).expand(bs, n)
    out = torch.full((bs, n, max_depth), -1, dtype=torch.long, device=tokens.device)
    for k in range(max_depth):
        on_path = depths.gather(1, node) >= 1
        out[:, :, k] = torch.where(on_path, tokens.gather(1, node).long(), -1)
        node = parents.gather(1, node).clamp(min=0)
    return out


def apply_tree_penalties(logits: torch.Tensor, counts: torch.Tensor, out_len: torch.Tensor,
                         params: PenaltyParams, paths: torch.Tensor,
                         depths: torch.Tensor) -> torch.Tensor:
    """Penalise [bs, N, V] float logits in place and return them.

    counts [bs, V]: how often each token occurs in the request's output so far (the root,
    i.e. the last committed token, included); out_len [bs]: output tokens so far; paths
    [bs, N, D] from `path_tokens`; depths [bs, N]."""
    bs, n, vocab = logits.shape
    freq = params.frequency.view(bs, 1, 1)
    pres = params.presence.view(bs, 1, 1)
    rep = params.repetition.view(bs, 1, 1)
    # Columns each node must recompute exactly: its path tokens and the stop tokens.
    # Padding points at column 0, which is then recomputed exactly as well.
    stops = params.stop_tokens.view(bs, 1, -1).expand(bs, n, -1)
    cols = torch.cat([paths, stops], dim=2).clamp(min=0)
    orig = logits.gather(2, cols)
    in_path = (paths.unsqueeze(2) == cols.unsqueeze(3)).sum(-1)
    total = counts.gather(1, cols.reshape(bs, -1)).view_as(cols).to(torch.float32) + in_path
    is_stop = (params.stop_tokens.view(bs, 1, 1, -1) == cols.unsqueeze(3)).any(-1)
    min_new_on = (out_len.view(bs, 1) + depths) < params.min_new_tokens.view(bs, 1)
    add = -freq * total - pres * (total > 0)
    add = add.masked_fill(is_stop & min_new_on.unsqueeze(2), float("-inf"))
    exact = _scale(orig + add, torch.where(total > 0, rep, torch.ones_like(rep)))

    c = counts.to(torch.float32).unsqueeze(1)
    logits.add_(-freq * c - pres * (c > 0))
    logits.copy_(_scale(logits, torch.where(c > 0, rep, torch.ones_like(rep))))
    logits.scatter_(2, cols, exact.to(logits.dtype))  # duplicate columns: identical values
    return logits


def _scale(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """SGLang's repetition scaling: x * r where x < 0, else x / r."""
    return torch.where(x < 0, x * r, x / r)


def reference_node_penalties(logits: torch.Tensor, history: list[int], vocab: int,
                             frequency: float, presence: float, repetition: float,
                             min_new_tokens: int, stop_tokens: set[int]) -> torch.Tensor:
    """[V] one position's penalised logits from its whole output history, written the plain
    way (dense counts); the oracle for `apply_tree_penalties` and the reference loop."""
    counts = torch.bincount(torch.tensor(history, dtype=torch.long), minlength=vocab)[:vocab]
    counts = counts.to(torch.float32)
    add = -frequency * counts - presence * (counts > 0).float()
    if len(history) < min_new_tokens:
        for t in stop_tokens:
            add[t] = float("-inf")
    x = logits.float() + add
    r = torch.where(counts > 0, torch.tensor(repetition), torch.tensor(1.0))
    return _scale(x, r)
