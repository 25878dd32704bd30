"""The target's choice at every tree node: argmax (greedy) or one draw from the processed
distribution, per row, vectorized.  One pipeline serves the reference loop and the engine.

Filters follow SGLang's own sampler (`top_k_top_p_min_p_sampling_from_probs_torch`, and
FlashInfer's `filter_apply_order="joint"`): softmax(logits / T), then top-k and top-p are both
measured on that *original* distribution (a token survives when its rank < k and the mass
strictly before it is <= p), then min-p drops tokens below min_p x the top probability.
Applying top-p first and top-k second on the renormalised result keeps exactly that set, which
is how the engine uses FlashInfer's fused renorm kernels without changing the meaning.

Sampling one token per node independently and walking the tree (acceptance.accept_tree) emits
exactly ancestral samples from the target, so no draft probabilities are needed.  With a
per-request seed the draw at a position is a pure function of (seed, position, distribution),
so a seeded request gives the same tokens whatever the batch, the tree or the decoding mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

Renorm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters (SGLang's meanings); temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or negative = no top-k cut
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


def torch_top_k_renorm(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k[row] largest probabilities (top_k >= vocab keeps all)."""
    ranks = torch.argsort(torch.argsort(probs, dim=-1, descending=True), dim=-1)
    return probs * (ranks < top_k.view(-1, 1))


def torch_top_p_renorm(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the tokens whose preceding mass (in descending order) is <= top_p[row]."""
    p = probs / probs.sum(dim=-1, keepdim=True)
    sorted_p, idx = torch.sort(p, dim=-1, descending=True)
    keep_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) <= top_p.view(-1, 1)
    keep = torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)
    return probs * keep


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor,
                   top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                   min_p: torch.Tensor | None = None, top_k_renorm: Renorm = torch_top_k_renorm,
                   top_p_renorm: Renorm = torch_top_p_renorm) -> torch.Tensor:
    """[rows, V] unnormalised probabilities after temperature and the joint filters (None
    skips a filter).  temperature [rows] > 0; top_k [rows] (>= V keeps all); top_p, min_p
    [rows].  The renorm functions are pluggable (probs, per-row value) -> probs so an engine
    can pass fused kernels; whether they renormalise does not matter, as every later step is
    invariant to a row's scale."""
    base = torch.softmax(logits.float() / temperature.view(-1, 1), dim=-1)
    probs = base
    if top_p is not None:
        probs = top_p_renorm(probs, top_p)
    if top_k is not None:
        probs = top_k_renorm(probs, top_k)
    if min_p is not None:  # relative to the top probability of the unfiltered distribution
        probs = probs * (base >= min_p.view(-1, 1) * base.max(dim=-1, keepdim=True).values)
    return probs


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, V] float64 uniforms in (0, 1), a pure function of (seed, position, token id):
    a 32-bit integer hash (lowbias32 rounds) of the three, computed in int64 lanes."""
    def mix(x: torch.Tensor) -> torch.Tensor:
        x = x & _MASK32
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & _MASK32
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & _MASK32
        return x ^ (x >> 16)

    row = mix(mix(seeds.long()) ^ (positions.long() & _MASK32))
    cols = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    h = mix(row.view(-1, 1) ^ mix(cols + 0x9E3779B9).view(1, -1))
    return (h.double() + 0.5) / 4294967296.0


def draw(probs: torch.Tensor, generator: torch.Generator | None = None,
         seeds: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row from (possibly unnormalised) probabilities, without host sync:
    argmax(p / E) with E ~ Exp(1) i.i.d. is an exact draw from p / sum(p).  Rows with
    seeds[row] >= 0 take E = -log(U) from `seeded_uniform(seed, positions[row])`."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    if seeds is not None:
        seeded = -torch.log(seeded_uniform(seeds.clamp(min=0), positions, probs.shape[-1]))
        noise = torch.where((seeds >= 0).view(-1, 1), seeded.to(noise.dtype), noise)
    return (probs / noise).argmax(dim=-1)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                top_k_renorm: Renorm = torch_top_k_renorm,
                top_p_renorm: Renorm = torch_top_p_renorm,
                generator: torch.Generator | None = None, seeds: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
    """[rows] one draw per row of [rows, V] logits from the filtered distribution."""
    probs = filtered_probs(logits, temperature, top_k, top_p, min_p, top_k_renorm, top_p_renorm)
    return draw(probs, generator, seeds, positions)


def target_choice(logits: torch.Tensor, params: list[SamplingParams],
                  generator: torch.Generator | None = None,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """[bs, N] the target's token at every node of [bs, N, V] logits: argmax for greedy
    requests, one independent draw per node otherwise.  positions [bs, N] (the node's input
    position) are needed only for seeded requests."""
    bs, n, vocab = logits.shape
    device = logits.device
    choice = logits.argmax(dim=-1)
    greedy = torch.tensor([p.greedy for p in params], device=device)
    if bool(greedy.all()):
        return choice

    def per_node(values, dtype):
        return torch.tensor(values, device=device, dtype=dtype).repeat_interleave(n)

    temperature = per_node([p.temperature if not p.greedy else 1.0 for p in params],
                           torch.float32)
    top_k = per_node([p.top_k if p.top_k > 0 else vocab for p in params], torch.long)
    top_p = per_node([p.top_p for p in params], torch.float32)
    min_p = per_node([p.min_p for p in params], torch.float32)
    seeds = None
    if any(p.seed is not None for p in params):
        if positions is None:
            raise ValueError("seeded sampling needs the nodes' positions")
        seeds = per_node([-1 if p.seed is None else p.seed for p in params], torch.long)
        positions = positions.reshape(-1)
    sampled = sample_rows(logits.reshape(bs * n, vocab), temperature, top_k, top_p, min_p,
                          generator=generator, seeds=seeds, positions=positions).view(bs, n)
    return torch.where(greedy.view(bs, 1), choice, sampled)
