"""The target's choice at every tree node: argmax (greedy) or one sample from the processed
distribution (temperature, then top-k, then top-p), per request, vectorized.

Sampling one token per node independently and walking the tree (acceptance.accept_tree) emits
exactly ancestral samples from the target, so no draft probabilities are needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters; temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or negative = no top-k cut

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                    top_k: torch.Tensor) -> torch.Tensor:
    """[bs, N, V] probabilities after temperature, top-k and top-p (renormalised).

    temperature, top_p: [bs] float; top_k: [bs] long (<= 0 = off).  Greedy rows (temperature 0)
    get a temperature of 1 here; callers take the argmax for them.
    """
    bs, n, vocab = logits.shape
    t = torch.where(temperature < 1e-5, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits.float() / t.view(bs, 1, 1), dim=-1)
    sorted_p, sorted_idx = torch.sort(probs, dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device).view(1, 1, vocab)
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    keep = rank < k.view(bs, 1, 1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep = keep & (mass_before < top_p.view(bs, 1, 1))
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_p)
    return out / out.sum(dim=-1, keepdim=True)


def target_choice(logits: torch.Tensor, params: list[SamplingParams],
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """[bs, N] the target's token at every node: argmax for greedy requests, one independent
    sample per node from the processed distribution otherwise."""
    bs, n, _ = logits.shape
    device = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=device)
    choice = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return choice
    temperature = torch.tensor([p.temperature for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    top_k = torch.tensor([p.top_k for p in params], device=device, dtype=torch.long)
    probs = processed_probs(logits, temperature, top_p, top_k)
    sampled = torch.multinomial(probs.view(bs * n, -1), 1, generator=generator).view(bs, n)
    return torch.where(greedy.view(bs, 1), choice, sampled)
