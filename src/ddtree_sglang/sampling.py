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
    """[bs, N, V] probabilities after temperature, then top-k, then top-p on the renormalised
    top-k distribution (SGLang's order), renormalised.

    temperature, top_p: [bs] float; top_k: [bs] long (<= 0 = off).  Greedy rows (temperature 0)
    get a temperature of 1 here; callers take the argmax for them.
    """
    bs, n, vocab = logits.shape
    t = torch.where(temperature < 1e-5, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits.float() / t.view(bs, 1, 1), dim=-1).view(bs * n, vocab)
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    probs = torch_top_k_renorm(probs, k.repeat_interleave(n))
    probs = torch_top_p_renorm(probs, top_p.repeat_interleave(n))
    return (probs / probs.sum(dim=-1, keepdim=True)).view(bs, n, vocab)


def target_choice(logits: torch.Tensor, params: list[SamplingParams],
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """[bs, N] the target's token at every node: argmax for greedy requests, one independent
    sample per node from the processed distribution otherwise."""
    bs, n, vocab = logits.shape
    device = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=device)
    choice = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return choice

    temperature = torch.tensor([p.temperature for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    top_k = torch.tensor([p.top_k for p in params], device=device, dtype=torch.long)
    probs = processed_probs(logits, temperature, top_p, top_k)
    sampled = draw(probs.view(bs * n, vocab), generator).view(bs, n)
    return torch.where(greedy.view(bs, 1), choice, sampled)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from (possibly unnormalised) probabilities, without host sync:
    argmax(p / E) with E ~ Exp(1) i.i.d. is an exact draw from p / sum(p)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def torch_top_k_renorm(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k[row] largest probabilities (top_k >= vocab keeps all)."""
    ranks = torch.argsort(torch.argsort(probs, dim=-1, descending=True), dim=-1)
    return probs * (ranks < top_k.view(-1, 1))


def torch_top_p_renorm(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest prefix (by probability) whose mass reaches top_p[row]."""
    p = probs / probs.sum(dim=-1, keepdim=True)
    sorted_p, idx = torch.sort(p, dim=-1, descending=True)
    keep_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < top_p.view(-1, 1)
    keep = torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)
    return probs * keep


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                top_k_renorm=torch_top_k_renorm, top_p_renorm=torch_top_p_renorm,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """[rows] one draw per row of [rows, V] logits from the processed distribution
    (temperature, then top-k, top-p, min-p; None skips a filter).  The renorm functions are
    pluggable so an engine can pass its fused kernels (probs, per-row value); whether they
    renormalise does not matter, as every later step is invariant to a row's scale."""
    probs = torch.softmax(logits.float() / temperature.view(-1, 1), dim=-1)
    if top_k is not None:
        probs = top_k_renorm(probs, top_k)
    if top_p is not None:
        probs = top_p_renorm(probs, top_p)
    if min_p is not None:
        probs = probs * (probs >= min_p.view(-1, 1) * probs.max(dim=-1, keepdim=True).values)
    return draw(probs, generator)
