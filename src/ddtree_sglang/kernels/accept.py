"""The acceptance walk of a verified tree, one launch for the whole batch.

`tree.stages.accept_stage` (PyTorch) propagates "accepted" down the tree with one gather per
depth and then scatters the path, committed tokens and KV rows out of it: about 60 small
kernels per step, GPU time at batch 1 that a DFLASH step does not pay.  Here one program per
request walks from the root: at each depth the child whose token is the target's choice at the
current node (siblings hold distinct tokens, so there is at most one) becomes the current
node, until none matches.  It writes the same five outputs as accept_stage.

Reference: `tree.stages.accept_stage`; `check_accept_kernel` compares the two at startup.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accept_kernel(tokens_ptr, parents_ptr, choice_ptr, len_ptr, index_ptr, rows_ptr,
                   bonus_ptr, out_ptr, N, D: tl.constexpr, W: tl.constexpr,
                   NP: tl.constexpr, WP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NP)
    valid = j < N
    tok = tl.load(tokens_ptr + r * N + j, mask=valid, other=-1)
    par = tl.load(parents_ptr + r * N + j, mask=valid, other=-2)
    w = tl.arange(0, WP)
    path = tl.where(w == 0, 0, -1).to(tl.int64)  # accepted node per depth; the root at 0
    nxt = tl.full([WP], -1, tl.int64)  # path shifted by one: the accepted draft nodes
    cur = tl.zeros([], tl.int64)
    length = tl.zeros([], tl.int32) + 1
    alive = length > 0
    for d in tl.static_range(1, D + 1):
        want = tl.load(choice_ptr + r * N + cur)
        hit = valid & (par == cur) & (tok == want)
        idx = tl.min(tl.where(hit, j, NP), 0).to(tl.int64)
        found = alive & (idx < NP)
        cur = tl.where(found, idx, cur)
        path = tl.where(found & (w == d), idx, path)
        nxt = tl.where(found & (w == d - 1), idx, nxt)
        length += found.to(tl.int32)
        alive = found
    bonus = tl.load(choice_ptr + r * N + cur)
    out = w < W
    tl.store(len_ptr + r, length)
    tl.store(index_ptr + r * W + w, tl.where(path >= 0, path + r * N, -1).to(tl.int32), mask=out)
    tl.store(rows_ptr + r * W + w, tl.maximum(path, 0) + r * N, mask=out)
    tl.store(bonus_ptr + r, bonus)
    drafted = tl.load(tokens_ptr + r * N + tl.maximum(nxt, 0), mask=out & (nxt >= 0), other=0)
    committed = tl.where(w < length - 1, drafted, tl.where(w == length - 1, bonus, 0))
    tl.store(out_ptr + r * W + w, committed, mask=out)


def accept_stage_triton(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                        choice: torch.Tensor, depth: int, out_width: int) -> tuple:
    """accept_stage's contract: [bs, N] tree tokens, parents (-1 at the root), depths and the
    target's choice per node -> (commit_lens int32, accept_index int32, feature_rows int64,
    bonus, tokens), the last three [bs, out_width] where shaped so.  `depths` is implied by
    the parents and not read."""
    bs, n = tokens.shape
    dev = tokens.device
    commit_lens = torch.empty(bs, dtype=torch.int32, device=dev)
    accept_index = torch.empty(bs, out_width, dtype=torch.int32, device=dev)
    feature_rows = torch.empty(bs, out_width, dtype=torch.int64, device=dev)
    bonus = torch.empty(bs, dtype=choice.dtype, device=dev)
    out_tokens = torch.empty(bs, out_width, dtype=torch.long, device=dev)  # as accept_stage
    if bs:
        _accept_kernel[(bs,)](tokens.contiguous(), parents.contiguous(), choice.contiguous(),
                              commit_lens, accept_index, feature_rows, bonus, out_tokens, n,
                              D=depth, W=out_width, NP=triton.next_power_of_2(n),
                              WP=triton.next_power_of_2(max(out_width, depth + 1)))
    return commit_lens, accept_index, feature_rows, bonus, out_tokens
