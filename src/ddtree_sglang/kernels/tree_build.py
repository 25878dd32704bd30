"""Fused Triton kernel for the draft-tree selection (B <= 256, depth <= 16), one program per
request.  Reference: ddtree_sglang.tree.builder.build_draft_tree, which it reproduces exactly (given
the same top-k of the draft positions).

The PyTorch builder spends its time launching two sorts and a few gathers per depth.  Here the
whole per-depth beam and the final best-first selection run in one program.  Ties are broken
like the reference (score desc, then depth, then lexicographic rank order) by sorting 63-bit
keys that pack an order-preserving image of the float32 score above the complement of the
candidate's index, so every key is distinct and the order is the reference's.

Per depth the beam's w entries times the K tokens of the next position give w x K candidates,
of which the best min(B, w x K) are kept.  Sorting all of them costs B^2 keys a depth (16,384
at B = 128), so the kernel sorts far fewer, exactly:
  1. A beam entry of score rank r (0 = best) can only contribute its best B // (r + 1) tokens:
     the entries ranked above it, times its own better tokens, all score at least as much.
     These candidates (at most sum_r B // (r + 1) ~ B ln B, e.g. 650 at B = 128) are sorted,
     and the new beam's worst key among them is a threshold T.
  2. The true best are all at or above T (T is the width-th best of a subset), so the kernel
     counts, per row, the candidates whose key reaches T (a row's keys fall as its token rank
     grows: a prefix of each row).  Usually no row has more than step 1 took, and step 1's
     sorted keys already start with the answer; a row has more only when float32 rounding
     makes a lower-ranked entry's sum tie a higher one's, and then the kernel gathers every
     candidate reaching T and sorts again, picking up what step 1 missed.  Only if more than
     CP candidates reach T (never seen; `overflow` reports it) would the beam be a different
     valid one, the output still lossless.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_sglang.tree.draft_tree import DraftTree, TopLogProbs, check_budget, torch_top_log_probs

MAX_BUDGET = 256
MAX_DEPTH = 16


@triton.jit
def _score_key(score, idx):
    """Descending order of score, then ascending idx, as a non-negative int64."""
    score = score + 0.0  # -0.0 -> +0.0, as float comparison treats them
    bits = score.to(tl.int32, bitcast=True).to(tl.int64)
    ordered = tl.where(bits >= 0, bits + 2147483648, -1 - bits)
    return (ordered << 31) + (2147483647 - idx)


@triton.jit
def _row_keys(prev, lp_d, lane, jj, K: tl.constexpr, BP: tl.constexpr):
    """Keys of the candidates (beam lane i, token rank j) for a chunk of ranks jj: [BP, JC]."""
    lp = tl.load(lp_d + jj, mask=jj < K, other=float("-inf"))
    return _score_key(prev[:, None] + lp[None, :], lane[:, None] * BP + jj[None, :])


@triton.jit
def _gather_row_prefixes(prev, lp_d, n, ck_row, lane, K: tl.constexpr, BP: tl.constexpr,
                         CP: tl.constexpr, JC: tl.constexpr):
    """Pack the keys of row i's first n[i] candidates into ck_row (rows in lane order, at most
    CP in all); returns how many there are (more than CP: the surplus was not written)."""
    offs = tl.cumsum(n, 0) - n
    for j0 in tl.static_range(0, BP, JC):
        jj = j0 + tl.arange(0, JC)
        pos = offs[:, None] + jj[None, :]
        ok = (jj[None, :] < n[:, None]) & (pos < CP)
        tl.store(ck_row + pos, _row_keys(prev, lp_d, lane, jj, K, BP), mask=ok)
    return tl.sum(n, 0)


@triton.jit
def _count_reaching(prev, lp_d, rows_ok, threshold, lane, K: tl.constexpr, BP: tl.constexpr,
                    JC: tl.constexpr):
    """How many of each row's candidates have a key >= threshold (a prefix of the row)."""
    n = tl.zeros([BP], tl.int32)
    for j0 in tl.static_range(0, BP, JC):
        jj = j0 + tl.arange(0, JC)
        hit = (_row_keys(prev, lp_d, lane, jj, K, BP) >= threshold) & rows_ok[:, None] \
            & (jj[None, :] < K)
        n += tl.sum(hit.to(tl.int32), 1)
    return n


@triton.jit
def _tree_kernel(top_lp, top_ids, beam_score, beam_tok, beam_par, cand_keys, rank_buf,
                 slot_buf, overflow, out_tok, out_par, out_depth, out_score,
                 DEPTH: tl.constexpr, K: tl.constexpr, B: tl.constexpr, BP: tl.constexpr,
                 BL: tl.constexpr, CP: tl.constexpr, JC: tl.constexpr):
    b = tl.program_id(0)
    lane = tl.arange(0, BP)
    cp_lane = tl.arange(0, CP)
    lp_row = top_lp + b * DEPTH * K
    id_row = top_ids + b * DEPTH * K
    bs_row = beam_score + b * BL * BP
    bt_row = beam_tok + b * BL * BP
    bp_row = beam_par + b * BL * BP
    ck_row = cand_keys + b * CP
    rk_row = rank_buf + b * BP
    overflowed = tl.zeros([], tl.int32)

    # Depth 1: the top-K tokens of position 1, already in rank (lexicographic) order.
    width = tl.zeros([], tl.int32) + min(B, K)
    valid = lane < width
    tl.store(bs_row + lane, tl.load(lp_row + lane, mask=valid, other=float("-inf")))
    tl.store(bt_row + lane, tl.load(id_row + lane, mask=valid, other=0))
    tl.store(bp_row + lane, tl.full([BP], -1, tl.int32))
    widths = tl.where(tl.arange(0, BL) == 0, width, 0)
    # a loop, not unrolled: the body's sorts compile once (unrolled over 15 depths, the
    # TritonGPU passes took minutes at B >= 16)
    for d in range(1, DEPTH):
        tl.debug_barrier()
        rows_ok = lane < width
        prev = tl.load(bs_row + (d - 1) * BP + lane, mask=rows_ok, other=float("-inf"))
        lp_d = lp_row + d * K
        new_width = tl.minimum(width * K, B)
        # score rank of every beam entry (score desc, lane asc: the candidates' own tie rule)
        ranked = tl.sort(tl.where(rows_ok, _score_key(prev, lane), -1), descending=True)
        tl.store(rk_row + (2147483647 - (ranked & 2147483647)), lane, mask=rows_ok)
        tl.debug_barrier()
        rank = tl.load(rk_row + lane, mask=rows_ok, other=0)
        # 1. rank r's best B // (r + 1) tokens; the new beam's worst key among them
        n = tl.where(rows_ok, tl.minimum(B // (rank + 1), K), 0)
        total = _gather_row_prefixes(prev, lp_d, n, ck_row, lane, K, BP, CP, JC)
        tl.debug_barrier()
        keys = tl.sort(tl.load(ck_row + cp_lane, mask=cp_lane < total, other=-1),
                       descending=True)
        threshold = tl.max(tl.where(cp_lane == new_width - 1, keys, -1), 0)
        tl.debug_barrier()
        # 2. every candidate reaching it: the exact best new_width are among them.  Only when a
        # row has more of those than step 1 took is there anything new to sort; otherwise they
        # are a subset of step 1's sorted keys, whose front is then already the answer.
        reach = _count_reaching(prev, lp_d, rows_ok, threshold, lane, K, BP, JC)
        if tl.max(reach - n, 0) > 0:
            total = _gather_row_prefixes(prev, lp_d, reach, ck_row, lane, K, BP, CP, JC)
            overflowed = tl.maximum(overflowed, (total > CP).to(tl.int32))
            tl.debug_barrier()
            keys = tl.sort(tl.load(ck_row + cp_lane, mask=cp_lane < tl.minimum(total, CP),
                                   other=-1), descending=True)
        tl.store(ck_row + cp_lane, keys)
        tl.debug_barrier()
        top = tl.load(ck_row + lane)  # the new_width best, best first
        chosen = 2147483647 - (top & 2147483647)
        chosen = tl.where(lane < new_width, chosen, 2147483647)
        chosen = tl.sort(chosen)  # back to lexicographic order
        sel = lane < new_width
        w = tl.where(sel, chosen // BP, 0)
        k = tl.where(sel, chosen % BP, 0)
        score = tl.load(bs_row + (d - 1) * BP + w) + tl.load(lp_row + d * K + k)
        tl.store(bs_row + d * BP + lane, tl.where(sel, score, float("-inf")))
        tl.store(bt_row + d * BP + lane, tl.load(id_row + d * K + k))
        tl.store(bp_row + d * BP + lane, w.to(tl.int32))
        width = new_width
        widths = tl.where(tl.arange(0, BL) == d, width, widths)
    tl.store(overflow + b, overflowed)
    tl.debug_barrier()

    # Best-first selection over every depth's beam (depth-major = depth, then lexicographic).
    flat = tl.arange(0, BL * BP)
    dep = flat // BP
    pos = flat % BP
    w_of = tl.sum(tl.where(tl.arange(0, BL)[None, :] == dep[:, None], widths[None, :], 0), 1)
    live = (dep < DEPTH) & (pos < w_of)
    sc = tl.load(bs_row + flat, mask=live, other=float("-inf"))
    keys = tl.where(live, _score_key(sc, flat.to(tl.int64)), -1)
    keys = tl.sort(keys, descending=True)
    order = tl.where(keys >= 0, 2147483647 - (keys & 2147483647), 0)
    first = flat < B
    slot_row = slot_buf + b * BL * BP
    tl.store(slot_row + order, flat.to(tl.int32), mask=first)
    tl.debug_barrier()
    od = order // BP
    par_pos = tl.load(bp_row + order, mask=first, other=-1)
    par_flat = tl.where(par_pos >= 0, (od - 1) * BP + par_pos, 0)
    par_slot = tl.load(slot_row + par_flat, mask=first & (par_pos >= 0), other=-1)
    tl.store(out_tok + b * B + flat, tl.load(bt_row + order, mask=first, other=0), mask=first)
    tl.store(out_par + b * B + flat, tl.where(par_pos >= 0, par_slot, -1).to(tl.int64), mask=first)
    tl.store(out_depth + b * B + flat, (od + 1).to(tl.int64), mask=first)
    tl.store(out_score + b * B + flat, tl.load(bs_row + order, mask=first, other=0.0), mask=first)


def supported(budget: int, depth: int) -> bool:
    return 1 <= budget <= MAX_BUDGET and 1 <= depth <= MAX_DEPTH


# Pointer types of the kernel's arguments, for ahead-of-time compilation (kernels/aot.py)
AOT_POINTERS = {"top_lp": "*fp32", "top_ids": "*i64", "beam_score": "*fp32", "beam_tok": "*i64",
                "beam_par": "*i32", "cand_keys": "*i64", "rank_buf": "*i32", "slot_buf": "*i32",
                "overflow": "*i32", "out_tok": "*i64", "out_par": "*i64", "out_depth": "*i64",
                "out_score": "*fp32"}


def launch_constants(budget: int, k: int, depth: int) -> dict:
    """The kernel's constexprs for a budget, K = min(budget, vocab) and a depth."""
    bp = max(2, triton.next_power_of_2(budget))
    return dict(DEPTH=depth, K=k, B=budget, BP=bp, BL=max(2, triton.next_power_of_2(depth)),
                CP=candidate_capacity(budget, k), JC=min(32, bp))


def candidate_capacity(budget: int, k: int) -> int:
    """Scratch keys per request and depth (a power of two): the largest first-pass candidate
    set, sum over ranks r < B of min(K, B // (r + 1)), which is at least the new beam's width
    (tests/test_kernels.py checks both on every B <= 256)."""
    most = sum(min(k, budget // (r + 1)) for r in range(budget))
    return max(2, triton.next_power_of_2(most))


def warps_for(capacity: int) -> int:
    """Warps per program: enough that the candidate sorts fit in registers (ptxas -v, sm_90,
    depth 15, benchmarks/results/tree_kernel_compile.md: 4 warps spill at most 12 bytes up to
    B = 64, 8 warps nothing at B = 128; B = 256 spilled ~1 KB a thread at 8 or 16)."""
    return 4 if capacity <= 512 else 8 if capacity <= 1024 else 16


def build_draft_tree_triton(draft_logits: torch.Tensor, budget: int,
                            overflow: torch.Tensor | None = None,
                            beams: dict | None = None,
                            top: TopLogProbs = torch_top_log_probs) -> DraftTree:
    """Same contract and result as tree.builder.build_draft_tree, for budget <= 256 and depth <= 16.
    `overflow` ([batch] int32, optional): set to 1 for a request whose second pass had more
    candidates than the scratch holds (see the module doc; its tree is then a valid other one).
    `beams` (optional dict, for tests): receives the per-depth beams, "score" / "token" /
    "parent" [batch, depth rows, lanes] in lexicographic order.  `top`: the top-k of the draft
    positions, as for tree.builder.build_draft_tree."""
    batch, depth, vocab = draft_logits.shape
    check_budget(budget, depth, vocab)
    if not supported(budget, depth):
        raise ValueError(f"the Triton tree kernel takes budget 1..{MAX_BUDGET} and depth "
                         f"1..{MAX_DEPTH}; got budget {budget}, depth {depth}")
    k = min(budget, vocab)
    top_lp, top_ids = top(draft_logits, k)
    const = launch_constants(budget, k, depth)
    bp, bl, cp = const["BP"], const["BL"], const["CP"]
    dev = draft_logits.device
    beam_score = torch.empty((batch, bl, bp), dtype=torch.float32, device=dev)
    beam_tok = torch.zeros((batch, bl, bp), dtype=torch.int64, device=dev)
    beam_par = torch.full((batch, bl, bp), -1, dtype=torch.int32, device=dev)
    cand_keys = torch.empty((batch, cp), dtype=torch.int64, device=dev)
    rank_buf = torch.empty((batch, bp), dtype=torch.int32, device=dev)
    slot_buf = torch.full((batch, bl * bp), -1, dtype=torch.int32, device=dev)
    if overflow is None:
        overflow = torch.empty(batch, dtype=torch.int32, device=dev)
    tokens = torch.empty((batch, budget), dtype=torch.int64, device=dev)
    parents = torch.empty_like(tokens)
    depths = torch.empty_like(tokens)
    scores = torch.empty((batch, budget), dtype=torch.float32, device=dev)
    _tree_kernel[(batch,)](top_lp.contiguous(), top_ids.contiguous(), beam_score, beam_tok,
                           beam_par, cand_keys, rank_buf, slot_buf, overflow, tokens, parents,
                           depths, scores, **const, num_warps=warps_for(cp))
    if beams is not None:
        beams.update(score=beam_score, token=beam_tok, parent=beam_par)
    return DraftTree(tokens=tokens, parents=parents, depths=depths, scores=scores)
