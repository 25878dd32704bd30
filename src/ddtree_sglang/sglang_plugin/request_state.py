"""Per-request GPU state the DDTREE verify step needs beyond SGLang's: output-token counts for
exact per-node penalties, and the host-side per-request settings read from the batch.

SGLang 0.5.17 keeps penalty counts in a per-batch orchestrator that speculative decode never
updates (and whose forward copy DDTREE cannot see), so DDTREE keeps its own: one row per
`req_pool_idx`, written at the request's prefill (its output so far, non-empty after a
retraction, plus the first token) and after every verify step (the committed tokens, bonus
included), all on the GPU in stream order.  The table is allocated on first use, when a request
with penalties arrives: int32 [rows, vocab] (e.g. 48 rows x 151,936 = 29 MB).
"""

from __future__ import annotations

from typing import Any

import torch

from ddtree_sglang.sampling.penalties import PenaltyParams


def penalty_settings(req: Any) -> tuple[float, float, float, int] | None:
    """(frequency, presence, repetition, min_new_tokens) when the request uses any, else None."""
    sp = req.sampling_params
    values = (float(sp.frequency_penalty or 0.0), float(sp.presence_penalty or 0.0),
              float(sp.repetition_penalty if sp.repetition_penalty is not None else 1.0),
              int(sp.min_new_tokens or 0))
    return None if values == (0.0, 0.0, 1.0, 0) else values


def min_new_stop_tokens(req: Any) -> set[int]:
    """The ids min_new_tokens suppresses: the same set as SGLang's BatchedMinNewTokensPenalizer
    (the request's stop_token_ids, the tokenizer's additional stop ids and its EOS)."""
    ids = set(req.sampling_params.stop_token_ids or ())
    tok = getattr(req, "tokenizer", None)
    if tok is not None:
        ids |= set(getattr(tok, "additional_stop_token_ids", None) or ())
        if getattr(tok, "eos_token_id", None) is not None:
            ids.add(int(tok.eos_token_id))
    return ids


def request_seeds(reqs: list, device) -> torch.Tensor | None:
    """[bs] each request's sampling_seed (-1 = none), or None when no request has one."""
    seeds = [getattr(r.sampling_params, "sampling_seed", None) for r in reqs]
    if all(s is None for s in seeds):
        return None
    return torch.tensor([-1 if s is None else int(s) for s in seeds],
                        dtype=torch.long).to(device, non_blocking=True)


class PenaltyState:
    """Output-token counts and output lengths per request slot, on the GPU."""

    def __init__(self, rows: int, vocab: int, device) -> None:
        self.rows, self.vocab, self.device = rows, vocab, device
        self.counts: torch.Tensor | None = None
        self.out_len: torch.Tensor | None = None

    def _ensure(self) -> None:
        if self.counts is None:
            self.counts = torch.zeros((self.rows, self.vocab), dtype=torch.int32,
                                      device=self.device)
            self.out_len = torch.zeros(self.rows, dtype=torch.int64, device=self.device)

    def on_prefill(self, reqs: list, first_tokens: torch.Tensor) -> None:
        """Reset the rows of the batch's requests that use penalties to their output so far
        (host lists, non-empty after a retraction) plus the token the prefill just produced."""
        rows = [i for i, r in enumerate(reqs) if penalty_settings(r) is not None]
        if not rows:
            return
        self._ensure()

        def dev(values):
            return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

        slots = dev([reqs[i].req_pool_idx for i in rows])
        self.counts.index_fill_(0, slots, 0)
        self.out_len.index_fill_(0, slots, 0)
        hist_slots = [reqs[i].req_pool_idx for i in rows for _ in reqs[i].output_ids]
        if hist_slots:
            tokens = [int(t) for i in rows for t in reqs[i].output_ids]
            hs, ht = dev(hist_slots), dev(tokens)
            self.counts.index_put_((hs, ht), torch.ones_like(hs, dtype=torch.int32),
                                   accumulate=True)
            self.out_len.index_add_(0, hs, torch.ones_like(hs))
        first = first_tokens.long()[dev(rows)]
        self.counts.index_put_((slots, first), torch.ones_like(slots, dtype=torch.int32),
                               accumulate=True)
        self.out_len.index_add_(0, slots, torch.ones_like(slots))

    def params(self, reqs: list) -> PenaltyParams | None:
        """Per-request settings for a decode batch, or None when no request uses penalties."""
        settings = [penalty_settings(r) for r in reqs]
        if all(s is None for s in settings):
            return None
        self._ensure()
        full = [s or (0.0, 0.0, 1.0, 0) for s in settings]
        stops = [min_new_stop_tokens(r) if s and s[3] > 0 else set()
                 for r, s in zip(reqs, settings)]
        return PenaltyParams.from_lists([s[0] for s in full], [s[1] for s in full],
                                        [s[2] for s in full], [s[3] for s in full], stops,
                                        self.device)

    def rows_of(self, req_pool_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = req_pool_indices.long()
        return self.counts[idx], self.out_len[idx]

    def commit(self, req_pool_indices: torch.Tensor, tokens: torch.Tensor,
               commit_lens: torch.Tensor) -> None:
        """Count one step's committed tokens ([bs, W], the first commit_lens[b] valid)."""
        bs, width = tokens.shape
        valid = torch.arange(width, device=tokens.device).view(1, -1) < commit_lens.view(-1, 1)
        slots = req_pool_indices.long().view(-1, 1).expand(bs, width)
        self.counts.index_put_((slots.reshape(-1), tokens.long().reshape(-1)),
                               valid.reshape(-1).to(torch.int32), accumulate=True)
        self.out_len.index_add_(0, req_pool_indices.long(), commit_lens.long())
