"""Log-probabilities of the tokens a verify step commits, from the target's own node logits.

Committed token j of a request is the target's choice at node path[j] of its accepted path (an
accepted child's token, then the bonus), so its log-probability is that node's row of the
verify logits, normalised.  Plain decoding computes the same numbers from the same
distribution (the logits after penalties and grammar mask, divided by the request's
temperature, before top-k / top-p / min-p filtering; 1 for greedy requests), so a client sees
the values it would see without speculation.
"""

from __future__ import annotations

import torch


def committed_log_probs(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                        temperatures: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row log-probabilities [bs * W, V], the committed tokens' [bs, W]).

    logits [bs * N, V]: processed verify logits (not yet scaled by temperature);
    rows [bs, W]: each committed position's node, a row of `logits` (StepCommit.feature_rows;
    positions past a request's commit point at a valid row and are never read);
    tokens [bs, W]: the committed tokens (StepCommit.tokens);
    temperatures [bs] or [bs, 1]: per request (None: 1 for all, the greedy convention).
    Rows that are all -inf stay finite (clamped to the dtype's lowest), as SGLang does."""
    bs, width = rows.shape
    picked = logits[rows.reshape(-1).long()].float()
    if temperatures is not None:
        picked = picked / temperatures.reshape(bs, 1).float().repeat_interleave(width, dim=0)
    row_lp = torch.log_softmax(picked, dim=-1)
    row_lp.clamp_(min=torch.finfo(row_lp.dtype).min)
    token_lp = row_lp.gather(1, tokens.reshape(-1, 1).long()).view(bs, width)
    return row_lp, token_lp
