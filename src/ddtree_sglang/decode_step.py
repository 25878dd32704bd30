"""Everything a DDTree decode step computes, engine-agnostic; the SGLang worker calls only this
module (plus `graphed` and `sampling`):

* the two fixed-shape stages it replays from CUDA graphs: drafter logits -> tree + verify
  layout (`tree_stage`, with the builder chosen by `select_builder`), and target choices ->
  acceptance in the form a KV-cache commit needs (`accept_stage`, or its one-launch Triton
  twin `fused_accept_stage()`, checked by `check_accept_kernel`);
* the tree attention mask in SGLang's FULL_MASK format (`verify_mask`), the per-node penalties
  (`penalise_nodes`), and the KV moves that put the accepted path at its committed positions
  (`kv_moves`, `move_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch

from ddtree_sglang.acceptance import accept_tree, committed_tokens
from ddtree_sglang.budget import expected_by_depth_per_request
from ddtree_sglang.kernels.kv_move import move_rows_reference
from ddtree_sglang.kernels.kv_move import move_rows_triton as move_rows
from ddtree_sglang.layout import VerifyLayout, build_verify_layout, truncate_layout
from ddtree_sglang.layout import full_mask as verify_mask
from ddtree_sglang.penalties import PenaltyParams, apply_tree_penalties, path_tokens
from ddtree_sglang.tree import (DraftTree, build_draft_tree, check_logsumexp_kernel,
                                check_topk_kernel)

__all__ = ["StepCommit", "VerifyLayout", "accept_stage", "check_accept_kernel", "check_builder",
           "check_kv_move_kernel", "check_logsumexp_kernel", "check_topk_kernel", "commit_slots",
           "fused_accept_stage", "kv_moves", "move_rows", "penalise_nodes", "select_builder",
           "tree_stage", "truncate_layout", "unpack_tree_stage", "verify_mask"]

Builder = Callable[[torch.Tensor, int], DraftTree]


# "auto" takes the fused kernel for every budget it serves (B <= 256): on an H200 it built the
# same trees as the PyTorch builder and faster at every batch 1-64 and budget 16-256 timed
# (benchmarks/results/h200_micro_2026-12-04: 0.12 vs 0.65 ms at batch 1, B = 16; 0.56 vs 1.19
# ms at B = 128; 3.15 vs 7.73 ms at batch 64, B = 256).  "torch" pins the PyTorch builder.


def select_builder(kernel: str, budget: int, depth: int) -> tuple[Builder, str]:
    """The tree builder for `kernel` ("auto", "triton" or "torch") and its name.  The fused
    Triton kernel ("auto" and "triton" alike) covers budget <= 256 and depth <= 16; anything
    else uses the exact PyTorch builder, which it reproduces bit for bit."""
    if kernel in ("triton", "auto"):
        from ddtree_sglang.kernels.tree_build import build_draft_tree_triton, supported

        if supported(budget, depth):
            return build_draft_tree_triton, "triton"
    return build_draft_tree, "torch"


def check_builder(builder: Builder, budget: int, depth: int, vocab: int, device,
                  dtype: torch.dtype) -> str | None:
    """Why `builder` cannot be trusted on this device (None if it can): it must build the same
    trees as the PyTorch builder on random and tied logits.  Run once at startup."""
    if builder is build_draft_tree:
        return None
    gen = torch.Generator(device=device).manual_seed(0)
    cases = [torch.randn((2, depth, vocab), generator=gen, device=device).mul(3).to(dtype),
             torch.zeros((1, depth, vocab), device=device, dtype=dtype)]  # all tied
    try:
        for logits in cases:
            ref, out = build_draft_tree(logits, budget), builder(logits, budget)
            if not all(torch.equal(getattr(ref, f), getattr(out, f))
                       for f in ("tokens", "parents", "depths")):
                return "it built a different tree than the PyTorch builder"
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use it
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def penalise_nodes(logits: torch.Tensor, counts: torch.Tensor, out_len: torch.Tensor,
                   params: PenaltyParams, tokens: torch.Tensor, parents: torch.Tensor,
                   depths: torch.Tensor, max_depth: int) -> None:
    """In place on [bs, N, V] node logits: each node's penalties as plain decoding would apply
    them there - the request's output counts plus the node's own path (penalties.py)."""
    paths = path_tokens(tokens, parents, depths, max_depth)
    apply_tree_penalties(logits, counts, out_len, params, paths, depths)


def tree_stage(draft_logits: torch.Tensor, roots: torch.Tensor, seq_lens: torch.Tensor,
               budget: int, depth: int, builder=build_draft_tree,
               candidate_budgets: tuple[int, ...] = ()) -> tuple:
    """[bs, L, V] drafter logits -> the VerifyLayout fields, as a flat tuple (graph outputs).

    With `candidate_budgets` (each <= budget) one more output follows: [bs, K, depth] the
    drafter's expected acceptance per depth of the tree cut to each candidate budget
    (budget.expected_by_depth_per_request), which the batch-aware budget choice reads."""
    tree = builder(draft_logits, budget)
    lay = build_verify_layout(tree, roots, seq_lens, max_depth=depth)
    out = tuple(getattr(lay, f.name) for f in fields(VerifyLayout))
    if candidate_budgets:
        out += (expected_by_depth_per_request(tree.scores, tree.depths, list(candidate_budgets),
                                              depth),)
    return out


def unpack_tree_stage(out: tuple) -> tuple[VerifyLayout, torch.Tensor | None]:
    """tree_stage's outputs -> (its VerifyLayout, the candidates' expected acceptance or None)."""
    n = len(fields(VerifyLayout))
    return VerifyLayout(*out[:n]), (out[n] if len(out) > n else None)


@dataclass(frozen=True)
class StepCommit:
    """What one verified step commits, per request (out_width = tokens a row can hold).

    commit_lens [bs] int32: tokens committed (accepted nodes + bonus).
    accept_index [bs, out_width] int32: the accepted path's rows in the flattened [bs * N]
        verify block (root first), -1 past the end - the format of EAGLE's accept_index.
    feature_rows [bs, out_width] int64: the same rows clamped to valid indices (for gathers;
        entries past commit_lens are never read).
    bonus [bs]: the target's token after the path.  tokens [bs, out_width]: committed tokens
        (accepted draft tokens, then the bonus), zero-padded.
    """

    commit_lens: torch.Tensor
    accept_index: torch.Tensor
    feature_rows: torch.Tensor
    bonus: torch.Tensor
    tokens: torch.Tensor


def accept_stage(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                 choice: torch.Tensor, depth: int, out_width: int) -> tuple:
    """Walk the trees along the target's choices; returns the StepCommit fields as a tuple."""
    bs, n = tokens.shape
    acc = accept_tree(tokens, parents, depths, choice, max_depth=depth)
    path = acc.accept_path[:, :out_width]
    rows = torch.arange(bs, device=tokens.device).unsqueeze(1) * n
    accept_index = torch.where(path >= 0, path + rows, torch.full_like(path, -1))
    out_tokens = committed_tokens(tokens, acc)[:, :out_width].clamp(min=0)
    return (acc.accept_len.to(torch.int32), accept_index.to(torch.int32),
            path.clamp(min=0) + rows, acc.bonus, out_tokens)


def random_verified_trees(bs: int, n: int, depth: int, vocab: int, gen: torch.Generator,
                          device) -> tuple[torch.Tensor, ...]:
    """(tokens, parents, depths, choice) of bs random verify blocks of n nodes (root at 0,
    siblings with distinct tokens, depth <= `depth`) and target choices that follow the tree
    often: test material for the acceptance walk."""
    parents = torch.full((bs, n), -1, dtype=torch.long)
    depths = torch.zeros((bs, n), dtype=torch.long)
    tokens = torch.zeros((bs, n), dtype=torch.long)
    for r in range(bs):
        used: dict[int, set] = {}
        for i in range(1, n):
            open_ = [p for p in range(i) if depths[r, p] < depth and
                     len(used.get(p, ())) < vocab]  # room for a child with a new token
            p = open_[int(torch.randint(0, len(open_), (1,), generator=gen))]
            t = int(torch.randint(0, vocab, (1,), generator=gen))
            while t in used.setdefault(p, set()):
                t = (t + 1) % vocab
            used[p].add(t)
            parents[r, i], depths[r, i], tokens[r, i] = p, depths[r, p] + 1, t
    choice = torch.randint(0, vocab, (bs, n), generator=gen)
    for r in range(bs):  # make the target follow a child at about half the nodes
        for i in range(n):
            kids = (parents[r] == i).nonzero().flatten()
            if len(kids) and torch.rand(1, generator=gen) < 0.6:
                choice[r, i] = tokens[r, kids[int(torch.randint(0, len(kids), (1,),
                                                                generator=gen))]]
    return tuple(x.to(device) for x in (tokens, parents, depths, choice))


def fused_accept_stage() -> Callable[..., tuple]:
    """The fused Triton acceptance walk (kernels/accept.py), accept_stage's drop-in."""
    from ddtree_sglang.kernels.accept import accept_stage_triton

    return accept_stage_triton


def check_accept_kernel(device, depth: int = 15, out_width: int = 16) -> str | None:
    """Why the fused Triton acceptance walk cannot replace accept_stage on this device (None
    if it can): both must give the same five outputs on random trees.  Run once at startup."""
    try:
        accept_stage_triton = fused_accept_stage()
        gen = torch.Generator().manual_seed(0)
        for bs, n in ((3, 33), (2, 16), (1, 70)):
            case = random_verified_trees(bs, n, depth, 5, gen, device)
            ref = accept_stage(*case, depth, out_width)
            out = accept_stage_triton(*case, depth, out_width)
            if not all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ref, out)):
                return "it accepted differently from accept_stage"
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use it
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def kv_moves(out_cache_loc: torch.Tensor, accept_index: torch.Tensor,
             commit_lens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, source) KV slots, [bs, out_width] each, that put every request's accepted path
    at its committed positions.

    out_cache_loc [bs * n]: the verify block's slots; slot j of request r holds position
    seq_len + j, so the committed token j belongs in out_cache_loc[r * n + j].  accept_index
    [bs, out_width]: the accepted rows of the flattened block (StepCommit).  Entries past the
    commit, and nodes already at their position, have source == target (nothing to move).
    A block narrower than out_width (a small budget) commits at most n tokens: n columns.
    """
    bs = accept_index.shape[0]
    width = min(accept_index.shape[1], n)
    accept_index = accept_index[:, :width]
    tgt = out_cache_loc.view(bs, n)[:, :width].long()
    j = torch.arange(width, device=accept_index.device)
    src = torch.where(j < commit_lens.view(bs, 1), out_cache_loc[accept_index.clamp(min=0).long()],
                      tgt)
    return tgt, src


def commit_slots(out_cache_loc: torch.Tensor, bs: int, n: int, out_width: int) -> torch.Tensor:
    """[bs, out_width] the KV slots of committed positions seq_len + j (the first out_width of
    each request's n verify slots), for writes that stop at each request's commit length.

    A verify narrower than out_width (a budget below the draft depth) commits at most n tokens;
    the columns past n repeat the last slot and are never written."""
    loc = out_cache_loc.view(bs, n)[:, :out_width]
    if n < out_width:
        loc = torch.cat([loc, loc[:, -1:].expand(bs, out_width - n)], dim=1)
    return loc.contiguous()


def check_kv_move_kernel(device, width: int = 16) -> str | None:
    """Why the Triton KV move cannot be used on this device (None if it can): it must move
    scratch rows exactly as move_rows_reference does, including a path that reads rows its own
    moves write.  Run once at startup."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        buffers = [torch.randint(0, 255, (4 * width, n), generator=gen, device=device,
                                 dtype=torch.uint8) for n in (256, 64)]
        base = torch.arange(2, device=device).view(2, 1) * 2 * width
        tgt = base + torch.arange(width, device=device)
        src = base + torch.stack([torch.randperm(2 * width, generator=gen, device=device)[:width]
                                  for _ in range(2)])
        expected = [b.clone() for b in buffers]
        move_rows_reference(expected, tgt, src)
        ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64, device=device)
        rows = torch.tensor([b.shape[1] for b in buffers], device=device)
        move_rows(ptrs, rows, 256, tgt, src)
        if all(torch.equal(a, b) for a, b in zip(buffers, expected)):
            return None
        return "it moved rows differently from the PyTorch reference"
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use it
        return f"{type(exc).__name__}: {str(exc)[:200]}"
