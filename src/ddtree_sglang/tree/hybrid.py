"""What a hybrid target's recurrent layers (gated delta / mamba) need from a DDTree verify.

Engine-agnostic: plain tensors in, plain tensors out; fixed shapes, no host synchronisation.
The conventions are SGLang 0.5.17's for EAGLE trees (topk > 1) on hybrid targets; file:line
refer to sglang/ under site-packages.

Tree links.  A verify of N tokens a request (tree index 0 = the root, the last committed bonus
token) hands the recurrent layers retrieve_next_token / retrieve_next_sibling [bs, N]: the first
(lowest-index) child and the next sibling in increasing index order, -1 for none.  EAGLE's
builder makes exactly these (kernels/ops/speculative/spec_tree.py:59-106 walks i = N-1..1 and
pushes i at the head of its parent's child list), and so does verify_layout.sibling_links.

Parent links.  retrieve_parent_token [bs, N] is not an input: the hybrid backend allocates it
empty (srt/layers/attention/hybrid_linear_attn_backend.py:195-202; the CUDA-graph buffer
:449-453) and the tree causal-conv kernel fills it from the two links in one pass over the
tokens in index order (kernels/ops/mamba/causal_conv1d_triton.py:559-573, :767-786, :806-827,
:977-986): at token i, parent[next_token[i]] = i and parent[next_sibling[i]] = parent[i].  The root's entry
stays 0.  That pass is right only when every node comes after its parent (the recurrent kernel
also reads the parent's state, written earlier in the same loop), which DDTree's best-first,
parents-first trees satisfy: `scan_order_ok` checks it.

Per-node states.  The gated-delta verify (kernels/ops/attention/fla/
fused_sigmoid_gating_recurrent.py:148-166, :291-305) starts token 0 from the committed state and
every other token i from the cached state of parent[i]; it writes the state after token i to
intermediate_ssm[layer][row, i] (row = the request's position in the batch, linear/utils.py:106;
steps: max_speculative_num_draft_tokens, mem_cache/memory_pool.py:679-700).  The conv
kernel writes node i's last K-1 inputs along its own path to intermediate_conv_window
[layer][row, i] (causal_conv1d_triton.py:860-876); that needs the dense window layout, which
SGLang allocates only when speculative_eagle_topk > 1 (memory_pool.py:117-132, :726-764).

Commit.  After the accept, the state to keep is the one after the last accepted node: its tree
index, not a chain row (speculative/spec_utils.py:781-803: accept_index[b, accept_lens[b] - 1]
- b * N, accept_lens counting the bonus, i.e. root + accepted nodes).  The backend copies
intermediate[row b, that index] into the request's persistent slot
(hybrid_linear_attn_backend.py:1183-1239; kernels/ops/mamba/mamba_state_scatter_triton.py:
457-499: dst[:, slot[b]] = src[:, b, step[b]], steps < 0 skipped).  With the radix cache's
mamba tracking (extra_buffer), the state after the token at a multiple of the track interval
also goes to the track slot: the path entry tracking_point - seq_len - 1 (spec_utils.py:
804-823).  DFLASH's own commit (speculative/dflash_worker_v2.py:1249-1296) takes commit_lens - 1
as the index: right for its chain, wrong for a tree.
"""

from __future__ import annotations

import torch

from ddtree_sglang.tree.acceptance import Acceptance


def retrieve_parent_token(parents: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[bs, N] parent tree index of every node, the root's entry 0: what SGLang's tree conv
    kernel writes into the hybrid backend's retrieve_parent_token (and what its recurrent
    kernel then reads).  `parents`: VerifyLayout.tree_parents (-1 at the root)."""
    out = parents.clamp(min=0)
    return out if dtype is None else out.to(dtype)


def scan_order_ok(parents: torch.Tensor) -> torch.Tensor:
    """[bs] bool: every node's parent has a smaller tree index, the order SGLang's one-pass
    parent derivation and per-node state reads need.  No host synchronisation (a debug check
    reads it; DDTree's builders always satisfy it)."""
    n = parents.shape[1]
    idx = torch.arange(n, device=parents.device)
    ok = (parents < idx) & (parents >= 0)
    ok[:, 0] = parents[:, 0] == -1
    return ok.all(dim=1)


def commit_steps(accept_index: torch.Tensor, commit_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[bs] int64: the tree index of each request's last accepted node (0 = the root when no
    draft node is accepted), whose recurrent state is the one to commit.

    accept_index [bs, W]: StepCommit.accept_index, rows of the flat [bs * width] verify block
    (EAGLE's accept_index); commit_lens [bs]: accepted nodes + 1 (EAGLE's accept_lens)."""
    bs = commit_lens.shape[0]
    last = accept_index.gather(1, (commit_lens.long() - 1).view(bs, 1)).view(bs).long()
    return last - torch.arange(bs, device=last.device) * width


def commit_steps_from_acceptance(acc: Acceptance) -> torch.Tensor:
    """commit_steps from a walk's Acceptance (accept_path holds tree indices already)."""
    bs = acc.accept_len.shape[0]
    return acc.accept_path.gather(1, (acc.accept_len.long() - 1).view(bs, 1)).view(bs)


def track_steps(accept_index: torch.Tensor, commit_lens: torch.Tensor, width: int,
                seq_lens: torch.Tensor, interval: int) -> torch.Tensor:
    """[bs] int64: for SGLang's mamba prefix tracking, the tree index of the accepted node at
    the position just below the multiple of `interval` this step's commit crosses (its state is
    the prefix state at that multiple), -1 where the commit crosses none.

    seq_lens [bs]: the committed lengths before this step (the root sits at position seq_len).
    Needs interval >= width (SGLang asserts mamba_track_interval >= the verify width), so a
    commit crosses at most one multiple."""
    bs = commit_lens.shape[0]
    pre = seq_lens.long()
    post = pre + commit_lens.long()
    crosses = pre // interval != post // interval
    point = post // interval * interval
    entry = (point - pre - 1).clamp(min=0).view(bs, 1)
    node = accept_index.gather(1, entry).view(bs).long() - torch.arange(
        bs, device=accept_index.device) * width
    return torch.where(crosses, node, torch.full_like(node, -1))
