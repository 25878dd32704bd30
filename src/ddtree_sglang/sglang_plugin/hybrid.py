"""DDTREE on hybrid targets (gated-delta layers between attention layers), SGLang's side.

SGLang 0.5.17 already verifies a tree on these targets for EAGLE topk > 1; DDTREE reuses that
path (tree/hybrid.py states the conventions, with file:line).  What it takes:

* The verify: nothing beyond today's EagleVerifyInput.  Its retrieve_next_token /
  retrieve_next_sibling are the tree links the recurrent layers scan along, and the conv kernel
  derives retrieve_parent_token from them.  But the hybrid backend's linear half passes the
  links only when its `topk` (read from --speculative-eagle-topk at its construction, which
  DDTREE sets to 1) is above 1, in the eager metadata and when CUDA graphs are captured and
  replayed (hybrid_linear_attn_backend.py:195, :525, :696): on every verify runtime's backend,
  before its graphs are captured, `tree_verify_backend`'s topk is raised to TREE_TOPK (a write
  for patches.py) and `tree_links_on` confirms it.
* The pool: per-node intermediate states (absent under --enable-linear-replayssm-spec) with a
  step per verify token, and dense conv windows (SGLang shares windows between consecutive
  steps when --speculative-eagle-topk <= 1, which is right for a chain only): `pool_problems`.
* The commit: after the accept, before batch.seq_lens moves, the state of each request's last
  accepted node into its slot (`commit_recurrent_state`), through the backend that ran the
  verify: SGLang's commit_mamba_states_after_verify would read model_runner.attn_backend, which
  the batch-aware budget has switched back to the configured width's by then, and DFLASH's own
  commit takes commit_lens - 1, a chain row.
"""

from __future__ import annotations

from typing import Any

import torch

from ddtree_sglang.sglang_plugin import sglang_api as sg
from ddtree_sglang.tree.hybrid import commit_steps, track_steps
from ddtree_sglang.tree.stages import StepCommit

# The hybrid backend only asks whether topk > 1 (a tree); no buffer is sized by it.
TREE_TOPK = 2


def linear_backend(attn_backend) -> Any | None:
    """The recurrent half of a target's attention backend, or None for a target without
    recurrent layers."""
    if isinstance(attn_backend, sg.HybridLinearAttnBackend):
        return attn_backend.linear_attn_backend
    return None


def tree_verify_backend(attn_backend) -> Any | None:
    """The recurrent half of a hybrid target's attention backend, which must verify along the
    tree: its `topk` raised to TREE_TOPK before its verify CUDA graphs are captured (the capture
    records whether the link buffers are bound; the write belongs to patches.py, like every
    write into SGLang's objects).  None for a target without recurrent layers; refused for
    recurrent layers other than gated-delta ones (the only tree verify checked here)."""
    linear = linear_backend(attn_backend)
    if linear is not None and not isinstance(linear, sg.GDNAttnBackend):
        raise RuntimeError(f"DDTREE verifies trees on gated-delta (GDN) hybrid targets only; "
                           f"this target's recurrent layers use {type(linear).__name__}")
    return linear


def tree_links_on(attn_backend) -> bool:
    """Whether a target's verify hands its recurrent layers the tree links (always true for a
    target without recurrent layers): a startup check, after the raise and before the capture."""
    linear = tree_verify_backend(attn_backend)
    return linear is None or (linear.topk or 0) > 1


def pool_problems(req_to_token_pool, width: int) -> list[str]:
    """Why a hybrid target's state pool cannot hold a `width`-token tree verify (empty when it
    can): the per-node states, a step per tree node, and a conv window per node."""
    cache = req_to_token_pool.get_speculative_mamba2_params_all_layers()
    mamba_pool = req_to_token_pool.mamba_pool
    problems = []
    if cache.intermediate_ssm is None or getattr(mamba_pool, "replayssm_spec_fold", False) \
            or getattr(mamba_pool, "replayssm_cache_base", None) is not None:
        problems.append("the recurrent state pool keeps no per-node verify states (ReplaySSM "
                        "speculative verify, --enable-linear-replayssm-spec, is chain-only)")
    elif cache.intermediate_ssm.shape[2] < width:
        problems.append(f"the recurrent state pool keeps {cache.intermediate_ssm.shape[2]} "
                        f"verify steps, the tree verifies {width} tokens a request")
    for window in cache.intermediate_conv_window:
        per_step = int(torch.Size(window.shape[3:]).numel())
        if window.stride(2) < per_step:
            problems.append("the conv windows of consecutive verify steps share memory (SGLang "
                            "lays them out so when --speculative-eagle-topk <= 1); a tree needs "
                            "one window per node")
            break
    return problems


def commit_recurrent_state(verify_backend, model, batch, step: StepCommit, width: int,
                           track_interval: int | None) -> None:
    """Each request's recurrent state after its last accepted node -> its persistent slot (and
    the prefix state at a crossed track interval -> its track slot when SGLang's mamba radix
    tracking is on), as SGLang commits EAGLE trees.

    verify_backend: the attention backend that ran this step's verify (its forward metadata
    holds the requests' state slots); step: the accept stage's StepCommit over the flat
    [bs * width] verify block; batch.seq_lens: still the lengths before this step;
    track_interval: SGLang's mamba_track_interval (read only when the batch tracks)."""
    bs = step.commit_lens.shape[0]
    track_slots = getattr(batch, "mamba_track_indices", None)
    track = None
    if track_slots is not None:
        if track_interval is None:
            raise ValueError("the batch tracks mamba prefix states: pass the track interval")
        track = track_steps(step.accept_index, step.commit_lens, width, batch.seq_lens[:bs],
                            track_interval)
    verify_backend.update_mamba_state_after_mtp_verify(
        last_correct_step_indices=commit_steps(step.accept_index, step.commit_lens, width),
        mamba_track_indices=track_slots, mamba_steps_to_track=track, model=model,
        req_pool_indices=batch.req_pool_indices[:bs])
