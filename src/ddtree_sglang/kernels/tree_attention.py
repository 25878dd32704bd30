"""Tree-verify attention in at most two Triton launches: the cached prefix split across programs
(flash-decoding), then the tree block under its mask, merged in one online softmax.

Why: SGLang's Triton extend kernel runs one program per (request, head, 64 queries) and walks
the whole prefix serially, so a verify of one request keeps a fraction of a large GPU's SMs
busy (32 of 132 on a Hopper) and reads its prefix at a fraction of the memory bandwidth; at
small batches attention is a large share of a Qwen3-8B verify step.  Here

  stage 1 (prefix): one program per (request, KV head, block of query rows, prefix split); the
    rows of a block are queries x the query heads sharing that KV head (GQA), so each prefix
    key is loaded once per KV head.  No mask: every verify query sees its whole prefix.
    Writes each split's normalised output and log-sum-exp (float32 scratch).
  stage 2 (tree + merge): one program per (request, KV head, block of rows): merges the splits
    and continues the online softmax over the <= B + 1 tree tokens, reading the tree part of
    SGLang's own custom mask (the prefix part of it is never read).
  When the batch alone gives enough programs (one split), stage 1 goes on with the tree itself
  and writes the output: one launch, no partials.

The arguments are SGLang's `extend_attention_fwd`'s, so the SGLang plugin installs it in
place of that kernel for tree verifies (sglang_plugin/verify_attention.py: `tree_verify_attention`
below is a drop-in for the calls `verify_attention.kernel_computes` accepts: KV at scale 1, no
logit cap; SGLang's kernel serves every other call).  Its PyTorch
reference is `reference_tree_attention` (float32, any prefix lengths and masks).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Tile shapes the kernel accepts (block_m: warps by default).  Each row block reads the whole
# prefix once, so a tree of more than 64 rows (B >= 16 at 4 grouped heads) reads it twice or
# more at 64 rows; 128-row blocks halve that at the price of registers.  Compiled for sm_90, a
# 64x64 tile uses all 255 registers and spills ~1.2 KB per thread in the fused launch (ptxas -v,
# benchmarks/results/tree_attention_registers.md); 32-key steps spill almost nothing.
# `default_tile` is what benchmarks/verify_attention.py measured fastest.
WARPS = {64: 4, 128: 8}
BLOCK_NS = (32, 64)
# Pointer types of a bf16 verify, for ahead-of-time compilation (kernels/aot.py)
AOT_POINTERS = {**{n: "*bf16" for n in ("Q", "K_buf", "V_buf", "K_ext", "V_ext", "O")},
                **{n: "*i64" for n in ("qo_indptr", "kv_indptr", "mask_indptr", "kv_indices")},
                "Mask": "*i1", "O_part": "*fp32", "L_part": "*fp32"}
WAVES = 2  # the split count aims at two waves of the GPU's SMs (264 programs on 132 SMs)


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc):
    """One online-softmax step: scores s [BM, BN] (-inf = not seen), values v [BN, D]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _attend_tree(q, m_i, l_i, acc, K_ext, V_ext, Mask, q_start, n_q, prefix, mask_start,
                 query, row_ok, kvh, d, d_ok, sm_scale, stride_kt, stride_kh, BN: tl.constexpr):
    """Continue the rows' online softmax over the request's tree tokens under SGLang's mask
    (row i of a request: prefix + n_q entries; the tree part starts at `prefix`)."""
    for start in range(0, n_q, BN):
        keys = start + tl.arange(0, BN)
        key_ok = keys < n_q
        k = tl.load(K_ext + (q_start + keys)[None, :] * stride_kt + kvh * stride_kh + d[:, None],
                    mask=key_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, k.to(q.dtype)).to(tl.float32) * sm_scale
        seen = tl.load(Mask + mask_start + query[:, None] * (prefix + n_q) + prefix
                       + keys[None, :], mask=row_ok[:, None] & key_ok[None, :], other=0)
        s = tl.where(key_ok[None, :] & (seen != 0), s, float("-inf"))
        v = tl.load(V_ext + (q_start + keys)[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def _prefix_kernel(Q, K_buf, V_buf, K_ext, V_ext, O, qo_indptr, kv_indptr, kv_indices, Mask,
                   mask_indptr, O_part, L_part, sm_scale, stride_qt, stride_qh, stride_kb,
                   stride_kh, stride_kt, stride_ekh, stride_out_t, stride_out_h,
                   stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
                   GROUP: tl.constexpr, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Stage 1: one prefix split of one block of rows.  With SPLITS == 1 the same program
    goes on with the tree and writes the final output (one launch in all)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mb = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    q_start = tl.load(qo_indptr + b)
    n_q = tl.load(qo_indptr + b + 1) - q_start
    kv_start = tl.load(kv_indptr + b)
    prefix = tl.load(kv_indptr + b + 1) - kv_start
    # whole key blocks per split: a split's partial output (float32, n_q x GROUP rows) should
    # not outweigh the keys it read (n_q x GROUP <= BN for a chain-sized tree)
    chunk = tl.cdiv(tl.cdiv(prefix, SPLITS), BN) * BN
    lo = split * chunk
    hi = tl.minimum(lo + chunk, prefix)
    active = mb * BM < n_q * GROUP
    if SPLITS > 1:  # a split past the prefix's end does nothing (stage 2 reads the used ones)
        active = active & (lo < prefix)
    if active:
        rows = mb * BM + tl.arange(0, BM)
        query = rows // GROUP  # rows are query-major: the GROUP heads of a query side by side
        head = kvh * GROUP + rows % GROUP
        row_ok = query < n_q
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        token = q_start + query
        q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, BLOCK_D], tl.float32)
        for start in range(lo, hi, BN):
            keys = start + tl.arange(0, BN)
            key_ok = keys < hi
            loc = tl.load(kv_indices + kv_start + keys, mask=key_ok, other=0).to(tl.int64)
            k = tl.load(K_buf + loc[None, :] * stride_kb + kvh * stride_kh + d[:, None],
                        mask=key_ok[None, :] & d_ok[:, None], other=0.0)
            s = tl.dot(q, k.to(q.dtype)).to(tl.float32) * sm_scale
            s = tl.where(key_ok[None, :], s, float("-inf"))
            v = tl.load(V_buf + loc[:, None] * stride_kb + kvh * stride_kh + d[None, :],
                        mask=key_ok[:, None] & d_ok[None, :], other=0.0)
            m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc)
        if SPLITS == 1:
            m_i, l_i, acc = _attend_tree(q, m_i, l_i, acc, K_ext, V_ext, Mask, q_start, n_q,
                                         prefix, tl.load(mask_indptr + b), query, row_ok, kvh,
                                         d, d_ok, sm_scale, stride_kt, stride_ekh, BN)
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(O + token[:, None] * stride_out_t + head[:, None] * stride_out_h
                     + d[None, :], out.to(O.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(O_part + token[:, None] * stride_ot + head[:, None] * stride_oh
                     + split * stride_os + d[None, :], out,
                     mask=row_ok[:, None] & d_ok[None, :])
            tl.store(L_part + token * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _tree_merge_kernel(Q, K_ext, V_ext, O, qo_indptr, kv_indptr, Mask, mask_indptr,
                       O_part, L_part, sm_scale, stride_qt, stride_qh, stride_kt, stride_kh,
                       stride_out_t, stride_out_h, stride_ot, stride_oh, stride_os,
                       stride_lt, stride_lh,
                       GROUP: tl.constexpr, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Stage 2 (SPLITS > 1): merge the used prefix splits, then the tree, then write."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mb = tl.program_id(2)
    q_start = tl.load(qo_indptr + b)
    n_q = tl.load(qo_indptr + b + 1) - q_start
    prefix = tl.load(kv_indptr + b + 1) - tl.load(kv_indptr + b)
    if mb * BM < n_q * GROUP:
        rows = mb * BM + tl.arange(0, BM)
        query = rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_ok = query < n_q
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        token = q_start + query
        # the used splits (stage 1's chunking) as one online-softmax state: running max m_i,
        # l_i = sum of exp(lse - m_i), acc = sum of exp(lse - m_i) x normalised output
        chunk = tl.cdiv(tl.cdiv(prefix, SPLITS), BN) * BN
        used = tl.cdiv(prefix, tl.maximum(chunk, 1))
        m_i = tl.full([BM], float("-inf"), tl.float32)
        for s in range(0, used):
            m_i = tl.maximum(m_i, tl.load(L_part + token * stride_lt + head * stride_lh + s,
                                          mask=row_ok, other=float("-inf")))
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, BLOCK_D], tl.float32)
        for s in range(0, used):
            w = tl.exp(tl.load(L_part + token * stride_lt + head * stride_lh + s,
                               mask=row_ok, other=float("-inf")) - m_safe)
            part = tl.load(O_part + token[:, None] * stride_ot + head[:, None] * stride_oh
                           + s * stride_os + d[None, :],
                           mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            acc += w[:, None] * part
            l_i += w
        q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i, l_i, acc = _attend_tree(q, m_i, l_i, acc, K_ext, V_ext, Mask, q_start, n_q, prefix,
                                     tl.load(mask_indptr + b), query, row_ok, kvh, d, d_ok,
                                     sm_scale, stride_kt, stride_kh, BN)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(O + token[:, None] * stride_out_t + head[:, None] * stride_out_h + d[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (from its properties, no device read); 132
    where there is no CUDA device (the interpreter)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def prefix_splits(batch_size: int, kv_heads: int, row_blocks: int, sms: int = 132) -> int:
    """How many programs share one request's prefix: enough for ~WAVES x `sms` programs in
    all (1 when the batch alone fills the GPU).  From host-known sizes only (no device read),
    so a CUDA graph of a batch size always records the same split count."""
    programs = batch_size * kv_heads * row_blocks
    return max(1, min(32, WAVES * sms // max(1, programs)))


def default_tile(batch_size: int, rows_per_kv_head: int) -> tuple[int, int]:
    """(block_m, block_n) for a verify of `batch_size` requests whose tree has
    `rows_per_kv_head` query rows per KV head (tree tokens x grouped heads).

    From the tile benchmark (benchmarks/verify_attention.py; Qwen3-8B heads, prefixes of 512
    and 1,024, batch 1 / 8 / 64): 32-key steps beat 64-key ones almost everywhere; a tree of
    65-128 rows (17-32 tokens) read by one 128-row block instead of two 64-row ones is faster
    from batch 8 on (the prefix is read once), slower at batch 1 (half the programs).  Trees of
    29-32 tokens were not timed: the 128-row rule is interpolated from 17."""
    block_m = 128 if 64 < rows_per_kv_head <= 128 and batch_size >= 8 else 64
    return block_m, 32


def tree_verify_attention(q_extend: torch.Tensor, k_extend: torch.Tensor,
                          v_extend: torch.Tensor, o_extend: torch.Tensor,
                          k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                          qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                          kv_indices: torch.Tensor, custom_mask: torch.Tensor,
                          mask_indptr: torch.Tensor, max_len_extend: int,
                          sm_scale: float, splits: int | None = None,
                          block_m: int | None = None, block_n: int | None = None,
                          num_warps: int | None = None) -> torch.Tensor:
    """Tree-verify attention into `o_extend` ([tokens, heads, dim]); see the module doc.
    `custom_mask`/`mask_indptr`: SGLang's flat per-request [n_q, prefix + n_q] masks.
    Tile: `block_m` query rows per program (one of WARPS), `block_n` keys per step (one of
    BLOCK_NS), `num_warps` (4 or 8; default WARPS[block_m]); unset: `default_tile`."""
    tokens, heads, dim = q_extend.shape
    kv_heads = k_extend.shape[1]
    group = heads // kv_heads
    bs = qo_indptr.shape[0] - 1
    auto_m, auto_n = default_tile(bs, max_len_extend * group)
    block_m, block_n = block_m or auto_m, block_n or auto_n
    if block_m not in WARPS or block_n not in BLOCK_NS or num_warps not in (None, 4, 8):
        raise ValueError(f"tile block_m={block_m}, block_n={block_n}, num_warps={num_warps} "
                         f"is not supported; accepted: block_m in {sorted(WARPS)}, block_n in "
                         f"{list(BLOCK_NS)}, num_warps 4 or 8")
    row_blocks = triton.cdiv(max_len_extend * group, block_m)
    splits = splits or prefix_splits(bs, kv_heads, row_blocks, _sm_count(q_extend.device))
    fused = splits == 1  # one program per row block does prefix and tree: one launch
    o_part = torch.empty(1 if fused else tokens, heads, splits, dim, device=q_extend.device,
                         dtype=torch.float32)
    l_part = torch.empty(1 if fused else tokens, heads, splits, device=q_extend.device,
                         dtype=torch.float32)
    block_d = triton.next_power_of_2(dim)
    meta = dict(GROUP=group, SPLITS=splits, HEAD_DIM=dim, BLOCK_D=block_d, BM=block_m,
                BN=block_n, num_warps=num_warps or WARPS[block_m])
    part_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(2), l_part.stride(0),
                    l_part.stride(1))
    _prefix_kernel[(bs, kv_heads, row_blocks * splits)](
        q_extend, k_buffer, v_buffer, k_extend, v_extend, o_extend, qo_indptr, kv_indptr,
        kv_indices, custom_mask, mask_indptr, o_part, l_part, sm_scale, q_extend.stride(0),
        q_extend.stride(1), k_buffer.stride(0), k_buffer.stride(1), k_extend.stride(0),
        k_extend.stride(1), o_extend.stride(0), o_extend.stride(1), *part_strides, **meta)
    if not fused:
        _tree_merge_kernel[(bs, kv_heads, row_blocks)](
            q_extend, k_extend, v_extend, o_extend, qo_indptr, kv_indptr, custom_mask,
            mask_indptr, o_part, l_part, sm_scale, q_extend.stride(0), q_extend.stride(1),
            k_extend.stride(0), k_extend.stride(1), o_extend.stride(0), o_extend.stride(1),
            *part_strides, **meta)
    return o_extend


def reference_tree_attention(q_extend: torch.Tensor, k_extend: torch.Tensor,
                             v_extend: torch.Tensor, k_buffer: torch.Tensor,
                             v_buffer: torch.Tensor, qo_indptr: torch.Tensor,
                             kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                             custom_mask: torch.Tensor, mask_indptr: torch.Tensor,
                             sm_scale: float) -> torch.Tensor:
    """Plain float32 attention of every request over its prefix and tree under SGLang's mask
    (the whole mask row is applied, prefix part included): the kernel's reference."""
    heads = q_extend.shape[1]
    group = heads // k_extend.shape[1]
    out = []
    for b in range(qo_indptr.shape[0] - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        k0, k1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
        n, loc = q1 - q0, kv_indices[k0:k1].long()
        keys = torch.cat([k_buffer[loc], k_extend[q0:q1]]).float().repeat_interleave(group, 1)
        vals = torch.cat([v_buffer[loc], v_extend[q0:q1]]).float().repeat_interleave(group, 1)
        m0 = int(mask_indptr[b])
        seen = custom_mask[m0:m0 + n * (k1 - k0 + n)].view(n, -1).bool()
        scores = torch.einsum("qhd,khd->hqk", q_extend[q0:q1].float(), keys) * sm_scale
        scores = scores.masked_fill(~seen.view(1, n, -1), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals))
    return torch.cat(out)
