"""Choosing the tree budget per decode batch: the most committed tokens per millisecond.

DDTree's own objective gives the value side for free.  The tree of the b best prefixes (the
builder's output, best-first) accepts on average

    E[accepted draft tokens | b] = sum of the b best prefix probabilities

when the target agrees with the drafter's marginals (each prefix is accepted exactly when all of
its tokens are), and every step commits one more token (the bonus).  Real targets disagree with
the drafter in a depth-dependent way, so `DepthCalibration` keeps, per depth, an EMA of observed
over predicted acceptance and scales the prediction with it.  The cost side is a table of step
times per (batch size, budget), measured by the engine.  `choose_budget` then maximises

    batch committed tokens / step time

over the budgets that have a cost.  Everything here is batched tensor code without host
synchronisation, so an engine can run it on the GPU and use the previous step's choice.
"""

from __future__ import annotations

import torch


def expected_by_depth(scores: torch.Tensor, depths: torch.Tensor, budgets: list[int],
                      max_depth: int) -> torch.Tensor:
    """[len(budgets), max_depth] predicted accepted nodes per depth, summed over the batch.

    scores [bs, B] best-first prefix log-probabilities (DraftTree.scores), depths [bs, B]
    (1 = child of the root).  Entry (i, d-1) = sum over requests of the probabilities of the
    depth-d prefixes among the first budgets[i] nodes, i.e. the expected number of requests
    that accept at least d tokens with a tree of that budget.
    """
    bs, width = scores.shape
    if max(budgets) > width:
        raise ValueError(f"budgets up to {max(budgets)} need a tree of that many nodes; got {width}")
    probs = scores.float().exp()
    onehot = torch.nn.functional.one_hot((depths - 1).clamp(0, max_depth - 1).long(),
                                         max_depth).to(probs.dtype)  # [bs, B, D]
    per_node = (probs.unsqueeze(-1) * onehot).sum(0)  # [B, D] summed over the batch
    cum = per_node.cumsum(0)  # first b nodes
    index = torch.tensor([b - 1 for b in budgets], device=scores.device)
    return cum.index_select(0, index)


class DepthCalibration:
    """Per-depth EMA of observed / predicted acceptance (starts at 1: trust the drafter)."""

    def __init__(self, max_depth: int, decay: float = 0.95, device: str | torch.device = "cpu"):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.ratio = torch.ones(max_depth, device=device)
        self._observed = torch.zeros(max_depth, device=device)
        self._predicted = torch.zeros(max_depth, device=device)

    def update(self, predicted: torch.Tensor, accept_lens: torch.Tensor) -> None:
        """predicted [max_depth]: expected requests accepting >= d tokens with the tree that was
        verified; accept_lens [bs]: accepted draft tokens per request (bonus excluded)."""
        d = torch.arange(1, self.ratio.numel() + 1, device=accept_lens.device)
        observed = (accept_lens.view(-1, 1) >= d).sum(0).to(self._observed.dtype)
        self._observed.mul_(self.decay).add_(observed, alpha=1 - self.decay)
        self._predicted.mul_(self.decay).add_(predicted.to(self._predicted.dtype),
                                              alpha=1 - self.decay)
        known = self._predicted > 1e-6
        self.ratio = torch.where(known, self._observed / self._predicted.clamp(min=1e-6),
                                 self.ratio)

    def corrected(self, by_depth: torch.Tensor) -> torch.Tensor:
        """[..., max_depth] predicted acceptance per depth -> calibrated expected accepted
        tokens [...] (each depth's prediction scaled by its observed ratio, capped at 1 per
        request by construction of the inputs)."""
        return (by_depth * self.ratio).sum(-1)


def choose_budget(batch_size: int, expected_accepted: torch.Tensor,
                  step_ms: torch.Tensor) -> torch.Tensor:
    """Index of the budget with the most committed tokens per millisecond.

    expected_accepted [K]: expected accepted draft tokens summed over the batch, per budget;
    step_ms [K]: the step time of each budget at this batch size (inf = not available).  Each
    request also commits its bonus token.  Ties go to the smaller budget (the first index).
    """
    rate = (expected_accepted + batch_size) / step_ms
    return torch.argmax(rate)  # first maximum

