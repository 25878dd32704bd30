"""Fused Triton kernel for the draft-tree selection (B <= 64, depth <= 16), one program per
request.  Reference: ddtree_sglang.tree.build_draft_tree, which it reproduces exactly.

The PyTorch builder spends its time launching two sorts and a few gathers per depth.  Here the
whole per-depth beam and the final best-first selection run in one program.  Ties are broken
like the reference (score desc, then depth, then lexicographic rank order) by sorting 63-bit
keys that pack an order-preserving image of the float32 score above the complement of the
candidate's index, so every key is distinct and the order is the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_sglang.tree import DraftTree, check_budget, top_log_probs

MAX_BUDGET = 64
MAX_DEPTH = 16
_IDX_BITS = 31


@triton.jit
def _score_key(score, idx):
    """Descending order of score, then ascending idx, as a non-negative int64."""
    score = score + 0.0  # -0.0 -> +0.0, as float comparison treats them
    bits = score.to(tl.int32, bitcast=True).to(tl.int64)
    ordered = tl.where(bits >= 0, bits + 2147483648, -1 - bits)
    return (ordered << 31) + (2147483647 - idx)


@triton.jit
def _tree_kernel(top_lp, top_ids, beam_score, beam_tok, beam_par, cand_keys, slot_buf,
                 out_tok, out_par, out_depth, out_score,
                 DEPTH: tl.constexpr, K: tl.constexpr, B: tl.constexpr, BP: tl.constexpr,
                 BL: tl.constexpr):
    b = tl.program_id(0)
    lane = tl.arange(0, BP)
    lp_row = top_lp + b * DEPTH * K
    id_row = top_ids + b * DEPTH * K
    bs_row = beam_score + b * BL * BP
    bt_row = beam_tok + b * BL * BP
    bp_row = beam_par + b * BL * BP
    ck_row = cand_keys + b * BP * BP

    # Depth 1: the top-K tokens of position 1, already in rank (lexicographic) order.
    width = min(B, K)
    valid = lane < width
    tl.store(bs_row + lane, tl.load(lp_row + lane, mask=valid, other=float("-inf")))
    tl.store(bt_row + lane, tl.load(id_row + lane, mask=valid, other=0))
    tl.store(bp_row + lane, tl.full([BP], -1, tl.int32))
    widths = tl.where(tl.arange(0, BL) == 0, width, 0)
    for d in tl.static_range(1, DEPTH):
        tl.debug_barrier()
        prev = tl.load(bs_row + (d - 1) * BP + lane, mask=lane < width, other=float("-inf"))
        lp_d = tl.load(lp_row + d * K + lane, mask=lane < K, other=float("-inf"))
        cand = prev[:, None] + lp_d[None, :]
        idx = lane[:, None] * BP + lane[None, :]
        ok = (lane[:, None] < width) & (lane[None, :] < K)
        keys = tl.where(ok, _score_key(cand, idx), -1)
        keys = tl.sort(tl.reshape(keys, [BP * BP]), descending=True)
        tl.store(ck_row + tl.arange(0, BP * BP), keys)
        tl.debug_barrier()
        new_width = min(B, width * K)
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


def build_draft_tree_triton(draft_logits: torch.Tensor, budget: int) -> DraftTree:
    """Same contract and result as tree.build_draft_tree, for budget <= 64 and depth <= 16."""
    batch, depth, vocab = draft_logits.shape
    check_budget(budget, depth, vocab)
    if not supported(budget, depth):
        raise ValueError(f"the Triton tree kernel takes budget 1..{MAX_BUDGET} and depth "
                         f"1..{MAX_DEPTH}; got budget {budget}, depth {depth}")
    k = min(budget, vocab)
    top_lp, top_ids = top_log_probs(draft_logits, k)
    bp = max(2, triton.next_power_of_2(budget))
    bl = max(2, triton.next_power_of_2(depth))
    dev = draft_logits.device
    beam_score = torch.empty((batch, bl, bp), dtype=torch.float32, device=dev)
    beam_tok = torch.zeros((batch, bl, bp), dtype=torch.int64, device=dev)
    beam_par = torch.full((batch, bl, bp), -1, dtype=torch.int32, device=dev)
    cand_keys = torch.empty((batch, bp * bp), dtype=torch.int64, device=dev)
    slot_buf = torch.full((batch, bl * bp), -1, dtype=torch.int32, device=dev)
    tokens = torch.empty((batch, budget), dtype=torch.int64, device=dev)
    parents = torch.empty_like(tokens)
    depths = torch.empty_like(tokens)
    scores = torch.empty((batch, budget), dtype=torch.float32, device=dev)
    _tree_kernel[(batch,)](top_lp.contiguous(), top_ids.contiguous(), beam_score, beam_tok,
                           beam_par, cand_keys, slot_buf, tokens, parents, depths, scores,
                           DEPTH=depth, K=k, B=budget, BP=bp, BL=bl)
    return DraftTree(tokens=tokens, parents=parents, depths=depths, scores=scores)
