"""The draft positions' top-K over a vocabulary split across tensor-parallel ranks.

With `--tp-size N` the target's lm_head is vocabulary-parallel: each rank holds the logits of
its own vocabulary shard only.  Every rank must build the same tree from the same global
distribution, so per drafted position each rank takes the top-K of its shard (with global token
ids) and its shard's logsumexp; one all-gather of those fixed-size pieces; then every rank
takes the exact global top-K of the N * K candidates and combines the shards' logsumexps into
the global one.  Fixed shapes, no host read: it runs inside the tree stage's CUDA graph, as
DFLASH's TP argmax does.

Order: candidates are ranked by (log-probability descending, token id ascending), the order
`canonical_top_log_probs` gives an unsharded row, so ties resolve the same way on every rank
and as without TP.  Any rank's shard may be smaller than K (its missing candidates are -inf).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# t -> [world, *t.shape]: every rank's t, in rank order, on every rank
Gather = Callable[[torch.Tensor], torch.Tensor]


def canonical_order(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor,
                                                                               torch.Tensor]:
    """The k best of (values, ids) along the last dim, by value descending, id ascending."""
    by_id = ids.argsort(dim=-1, stable=True)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    order = values.argsort(dim=-1, descending=True, stable=True)[..., :k]
    return values.gather(-1, order), ids.gather(-1, order)


def canonical_top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tree.TopLogProbs with ties in token order: float32 log-probabilities [.., k] and
    ids, by (log-probability descending, id ascending)."""
    ids = torch.arange(logits.shape[-1], device=logits.device).expand(logits.shape)
    lp = logits.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    return canonical_order(lp, ids, k)


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary: global ids start..start + valid, the first `valid`
    columns of its logits (the rest pad every rank's shard to one width, so all ranks run the
    same shapes), and the all-gather over the tensor-parallel group."""

    start: int
    valid: int
    gather: Gather

    def top_log_probs(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """draft_tree.TopLogProbs over the whole vocabulary, from this rank's shard `logits`
        [.., width] (columns past `valid` are padding)."""
        width = logits.shape[-1]
        column = torch.arange(width, device=logits.device)
        logits = logits.float().masked_fill(column >= self.valid, float("-inf"))
        local = min(k, width)
        values, ids = canonical_order(logits, column.expand(logits.shape), local)
        ids = torch.where(values > float("-inf"), ids, -1)
        if local < k:  # a shard narrower than k: pad with candidates that never win
            pad = values.new_full((*values.shape[:-1], k - local), float("-inf"))
            values = torch.cat([values, pad], -1)
            ids = torch.cat([ids, torch.full_like(pad, -1, dtype=ids.dtype)], -1)
        ids = torch.where(ids >= 0, ids + self.start, ids)
        lse = torch.logsumexp(logits, dim=-1)
        all_values, all_ids = self.gather(values), self.gather(ids)  # [world, .., k]
        global_lse = torch.logsumexp(self.gather(lse), dim=0)
        cand_values = all_values.movedim(0, -2).flatten(-2)  # [.., world * k]
        cand_ids = all_ids.movedim(0, -2).flatten(-2)
        cand_ids = torch.where(cand_ids >= 0, cand_ids, torch.iinfo(cand_ids.dtype).max)
        top_values, top_ids = canonical_order(cand_values, cand_ids, k)
        return top_values - global_lse.unsqueeze(-1), top_ids
