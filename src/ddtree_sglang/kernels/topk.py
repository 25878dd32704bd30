"""Top-k and the float32 log-normaliser of half-precision logit rows, in one pass over the row.

The tree needs, per draft position, the k <= B most probable tokens and log q = logit - lse.
`torch.topk` over [bs x depth, 151,936] bf16 logits is a multi-pass radix select (about a
millisecond per step at batch 64) and the logsumexp reads the row again.
Here the row is cut into chunks: one program per (row, chunk) loads its chunk once, keeps the
chunk's max and sum of exponentials, and extracts the chunk's k largest values by repeated
max (k <= 64); a small torch.topk over the chunks' candidates and a log-sum-exp merge of the
chunk sums finish the job.  Any k largest values of a row are among its chunks' k largest.

Reference: torch.topk on the logits and torch.logsumexp in float32 (`top_log_probs_reference`).
Equal logits may be returned in another order than torch.topk's (both are valid top-k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 64


@triton.jit
def _chunk_topk_kernel(x_ptr, vals_ptr, ids_ptr, max_ptr, sum_ptr, V, stride, n_chunks,
                       K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    neg_inf = float("-inf")
    off = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride + off, mask=off < V, other=neg_inf).to(tl.float32)
    top = tl.max(x, 0)
    total = tl.sum(tl.where(x != neg_inf, tl.exp(x - top), 0.0), 0)
    slot = row * n_chunks + chunk
    tl.store(max_ptr + slot, top)
    tl.store(sum_ptr + slot, total)
    kk = tl.arange(0, KP)
    vals = tl.full([KP], neg_inf, tl.float32)
    ids = tl.zeros([KP], tl.int64)
    for j in tl.static_range(K):
        v = tl.max(x, 0)
        i = tl.argmax(x, 0)
        vals = tl.where(kk == j, v, vals)
        ids = tl.where(kk == j, (chunk * CHUNK + i).to(tl.int64), ids)
        x = tl.where(off == chunk * CHUNK + i, neg_inf, x)
    keep = kk < K
    tl.store(vals_ptr + slot * K + kk, vals, mask=keep)
    tl.store(ids_ptr + slot * K + kk, ids, mask=keep)


def top_log_probs_triton(logits: torch.Tensor, k: int,
                         chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., V] logits -> (float32 log-probabilities, int64 ids) of the k most probable tokens
    per row, sorted descending, [..., k] each."""
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be in 1..{MAX_K} for the Triton top-k; got {k}")
    shape, vocab = logits.shape[:-1], logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n, chunks = rows.shape[0], triton.cdiv(vocab, chunk)
    dev = logits.device
    vals = torch.empty(n, chunks * k, dtype=torch.float32, device=dev)
    ids = torch.empty(n, chunks * k, dtype=torch.int64, device=dev)
    maxes = torch.empty(n, chunks, dtype=torch.float32, device=dev)
    sums = torch.empty(n, chunks, dtype=torch.float32, device=dev)
    if n:
        _chunk_topk_kernel[(n, chunks)](rows, vals, ids, maxes, sums, vocab, rows.stride(0),
                                        chunks, K=k, KP=triton.next_power_of_2(k), CHUNK=chunk,
                                        num_warps=8)
    best, where = torch.topk(vals, k, dim=-1)
    top = maxes.amax(dim=-1, keepdim=True)
    scale = torch.where(maxes == float("-inf"), 0.0, torch.exp(maxes - top))
    lse = top.squeeze(-1) + torch.log((sums * scale).sum(-1))
    return ((best - lse.unsqueeze(-1)).view(*shape, k), ids.gather(1, where).view(*shape, k))


def top_log_probs_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.topk(logits, k, dim=-1)
    return values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True), ids


def is_valid_top_k(logits: torch.Tensor, k: int, log_probs: torch.Tensor, ids: torch.Tensor,
                   atol: float = 1e-4) -> bool:
    """Whether (log_probs, ids) is a correct top-k of `logits` with equal logits in any order:
    the same sorted values as the reference, distinct ids, and each id's own log-probability."""
    ref, _ = top_log_probs_reference(logits, k)
    own = logits.float().gather(-1, ids) - torch.logsumexp(logits.float(), -1, keepdim=True)
    distinct = bool((ids.sort(-1).values.diff(dim=-1) != 0).all()) if k > 1 else True
    return (torch.allclose(log_probs, ref, atol=atol, rtol=0) and distinct
            and torch.allclose(own, log_probs, atol=atol, rtol=0))
