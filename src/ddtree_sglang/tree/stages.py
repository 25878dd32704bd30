"""Everything a DDTree decode step computes on its tensors, engine-agnostic (the SGLang plugin's
graphed_stages.py captures the two stages; sampling/ and kernels/choice.py supply the rest):

* the two fixed-shape stages an engine replays from CUDA graphs: drafter logits -> tree +
  verify layout of every candidate width (`tree_stage`), and target choices -> acceptance
  (`accept_stage`, or the Triton twin kernels.choice.Kernels picks) with everything the commit
  computes from it (`commit_stage`: the KV moves that put the accepted path at its committed
  positions, `kv_moves`, the draft-KV slots and positions, `commit_slots`, the new lengths);
* the tree attention mask in SGLang's FULL_MASK format (`full_mask`) and the per-node
  penalties (`penalise_nodes`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch

from ddtree_sglang.tree.acceptance import (Acceptance, accept_tree, best_path_acceptance,
                                           committed_tokens)
from ddtree_sglang.budget.controller import expected_by_depth_per_request
from ddtree_sglang.tree.draft_tree import DraftTree
from ddtree_sglang.tree.verify_layout import (VerifyLayout, build_verify_layout, full_mask,
                                              mask_positions, truncate_layout)
from ddtree_sglang.sampling.penalties import PenaltyParams, apply_tree_penalties, path_tokens

__all__ = ["CommitSlots", "StepCommit", "TreeStageOutput", "VerifyLayout", "accept_stage",
           "commit_slots", "commit_stage", "kv_moves", "penalise_nodes", "stage_widths",
           "tree_stage", "truncate_layout", "unpack_commit_stage", "unpack_tree_stage",
           "full_mask", "verify_widths"]

# (draft logits [bs, L, V], budget) -> the B-best trees (kernels.choice.Kernels.build_tree)
Builder = Callable[[torch.Tensor, int], DraftTree]


def penalise_nodes(logits: torch.Tensor, counts: torch.Tensor, out_len: torch.Tensor,
                   params: PenaltyParams, tokens: torch.Tensor, parents: torch.Tensor,
                   depths: torch.Tensor, max_depth: int) -> None:
    """In place on [bs, N, V] node logits: each node's penalties as plain decoding would apply
    them there - the request's output counts plus the node's own path (penalties.py)."""
    paths = path_tokens(tokens, parents, depths, max_depth)
    apply_tree_penalties(logits, counts, out_len, params, paths, depths)


# Verify widths up to this get their mask positions from the tree stage (bs * N * N int64
# each: 0.56 MB at N = 33, bs = 64); wider ones are placed on the host per step.
MASK_POSITIONS_MAX_WIDTH = 128


def verify_widths(budget: int, candidate_budgets: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Every verify width a step may use (the candidates' and B's, + 1 each), ascending."""
    return tuple(sorted({budget + 1, *(c + 1 for c in candidate_budgets)}))


def stage_widths(budget: int, candidate_budgets: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The verify widths whose mask positions the tree stage computes, ascending."""
    return tuple(w for w in verify_widths(budget, candidate_budgets)
                 if w <= MASK_POSITIONS_MAX_WIDTH)


@dataclass(frozen=True)
class TreeStageOutput:
    """What the tree stage hands the rest of the step, per verify width of the step's
    candidates: the tree cut to that width (layouts), where its ancestor blocks go in the flat
    verify mask (mask_positions; widths above MASK_POSITIONS_MAX_WIDTH are placed on the host),
    the candidates' expected acceptance per depth (depth_probs [bs, K, depth], None when the
    budget is pinned) and the committed lengths the tree was built at (seq_lens [bs])."""

    layouts: dict[int, VerifyLayout]
    mask_positions: dict[int, torch.Tensor]
    depth_probs: torch.Tensor | None
    seq_lens: torch.Tensor


def tree_stage(draft_logits: torch.Tensor, roots: torch.Tensor, seq_lens: torch.Tensor,
               budget: int, depth: int, builder: Builder,
               candidate_budgets: tuple[int, ...] = ()) -> tuple:
    """[bs, L, V] drafter logits -> a flat tuple of fixed-shape tensors (graph outputs) that
    unpack_tree_stage reads back as a TreeStageOutput: the B-best tree's verify layout cut to
    every verify width (verify_widths), the mask positions of every width of stage_widths
    (verify_layout.mask_positions), with `candidate_budgets` (each <= budget) [bs, K, depth]
    the drafter's expected acceptance per depth of the tree cut to each candidate
    (budget.controller.expected_by_depth_per_request), and the lengths."""
    tree = builder(draft_logits, budget)
    full = build_verify_layout(tree, roots, seq_lens, max_depth=depth)
    out: tuple = ()
    for width in verify_widths(budget, candidate_budgets):
        lay = truncate_layout(full, width)
        out += tuple(getattr(lay, f.name) for f in fields(VerifyLayout))
    out += tuple(mask_positions(seq_lens, w) for w in stage_widths(budget, candidate_budgets))
    if candidate_budgets:
        out += (expected_by_depth_per_request(tree.scores, tree.depths, list(candidate_budgets),
                                              depth),)
    return out + (seq_lens,)


def unpack_tree_stage(out: tuple, budget: int,
                      candidate_budgets: tuple[int, ...] = ()) -> TreeStageOutput:
    """tree_stage's flat outputs (for the same budget and candidates) -> TreeStageOutput."""
    n = len(fields(VerifyLayout))
    widths = verify_widths(budget, candidate_budgets)
    layouts = {w: VerifyLayout(*out[i * n:(i + 1) * n]) for i, w in enumerate(widths)}
    rest = out[len(widths) * n:]
    placed = stage_widths(budget, candidate_budgets)
    positions = dict(zip(placed, rest[:len(placed)]))
    rest = rest[len(placed):]
    return TreeStageOutput(layouts=layouts, mask_positions=positions,
                           depth_probs=rest[0] if len(rest) > 1 else None, seq_lens=rest[-1])


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
    return step_commit_fields(tokens, accept_tree(tokens, parents, depths, choice,
                                                  max_depth=depth), out_width)


def forced_accept_stage(forced_len: torch.Tensor,
                        fixed_token: int | None = None) -> Callable[..., tuple]:
    """accept_stage's twin for a benchmark's forced acceptance (best_path_acceptance): the
    commit lengths come from `forced_len` [>= bs] (a fixed-address tensor the caller fills
    each step), the path is the tree's best; with `fixed_token` every committed token is that
    id (SGLang's "fixed" token mode), else the path's tokens and the target's bonus."""
    def stage(tokens, parents, depths, choice, depth: int, out_width: int) -> tuple:
        forced = forced_len[: tokens.shape[0]]
        out = step_commit_fields(tokens, best_path_acceptance(parents, depths, choice, depth,
                                                              forced), out_width)
        if fixed_token is None:
            return out
        commit_lens, accept_index, feature_rows, bonus, committed = out
        return (commit_lens, accept_index, feature_rows, torch.full_like(bonus, fixed_token),
                torch.full_like(committed, fixed_token))
    return stage


def step_commit_fields(tokens: torch.Tensor, acc: Acceptance, out_width: int) -> tuple:
    """A walk's Acceptance -> the StepCommit fields as a tuple."""
    bs, n = tokens.shape
    path = acc.accept_path[:, :out_width]
    rows = torch.arange(bs, device=tokens.device).unsqueeze(1) * n
    accept_index = torch.where(path >= 0, path + rows, torch.full_like(path, -1))
    out_tokens = committed_tokens(tokens, acc)[:, :out_width].clamp(min=0)
    return (acc.accept_len.to(torch.int32), accept_index.to(torch.int32),
            path.clamp(min=0) + rows, acc.bonus, out_tokens)


@dataclass(frozen=True)
class CommitSlots:
    """Where one step's committed tokens go, computed with the walk (commit_stage).

    kv_target, kv_source [bs, min(N, out_width)]: the KV rows that put each accepted path at
        its committed positions (kv_moves).
    draft_slots [bs, out_width]: the KV slots of committed positions seq_len + j
        (commit_slots); draft_positions [bs, out_width]: those positions, where the committed
        tokens' target features enter the draft KV.
    new_seq_lens [bs]: the lengths after the commit.
    """

    kv_target: torch.Tensor
    kv_source: torch.Tensor
    draft_slots: torch.Tensor
    draft_positions: torch.Tensor
    new_seq_lens: torch.Tensor


def commit_stage(accept: Callable[..., tuple], tokens: torch.Tensor, parents: torch.Tensor,
                 depths: torch.Tensor, choice: torch.Tensor, out_cache_loc: torch.Tensor,
                 seq_lens: torch.Tensor, depth: int, out_width: int) -> tuple:
    """The walk (`accept`: accept_stage or its Triton twin) and what the commit needs from it,
    in one fixed-shape stage (CUDA-graphed): StepCommit's fields, then CommitSlots'.
    out_cache_loc [bs, N]: the verify's KV slots; seq_lens [bs]: the committed lengths."""
    walk = tuple(accept(tokens, parents, depths, choice, depth, out_width))
    bs, n = tokens.shape
    flat = out_cache_loc.reshape(-1)
    target, source = kv_moves(flat, walk[1], walk[0], n)
    positions = seq_lens.view(bs, 1).to(torch.int64) + torch.arange(out_width,
                                                                    device=seq_lens.device)
    return (*walk, target, source, commit_slots(flat, bs, n, out_width), positions,
            seq_lens + walk[0].to(seq_lens.dtype))


def unpack_commit_stage(out: tuple) -> tuple[StepCommit, CommitSlots]:
    n = len(fields(StepCommit))
    return StepCommit(*out[:n]), CommitSlots(*out[n:])


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
