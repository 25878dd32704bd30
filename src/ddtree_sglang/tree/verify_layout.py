"""Verify layout: a batch of draft trees flattened into what a tree-verify target pass consumes.

Each request verifies N = B + 1 tokens: the root (the last committed "bonus" token, which the
target has not processed yet) at tree index 0, then the B draft nodes in tree order (node i of
the DraftTree is tree index i + 1).  The arrays below carry the same meaning as those SGLang's
EAGLE path builds (eagle_utils.build_tree_kernel_efficient, verify_tree_greedy):

* draft_tokens [bs * N]: root first, then the nodes.
* positions    [bs * N]: seq_len + depth (root depth 0); siblings share a position.
* ancestors    [bs, N, N] bool: row i is True on i's ancestors and i itself (root included).
* full_mask    flat bool: per request a row-major N x (seq_len + N) block, prefix columns all
  True, then the ancestor block; requests concatenated (SGLang's TreeMaskMode.FULL_MASK).
* retrieve_index [bs, N] = b * N + i; retrieve_next_token [bs, N] = first (lowest-index) child,
  -1 if none; retrieve_next_sibling [bs, N] = next sibling in index order, -1 if none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree_sglang.tree.draft_tree import DraftTree


@dataclass(frozen=True)
class VerifyLayout:
    draft_tokens: torch.Tensor
    positions: torch.Tensor
    ancestors: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor
    tree_parents: torch.Tensor  # [bs, N] parent tree index, -1 for the root
    tree_depths: torch.Tensor  # [bs, N] depth, 0 for the root

    @property
    def num_tokens_per_req(self) -> int:
        return self.retrieve_index.shape[1]


def tree_parents_and_depths(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """Parent and depth arrays over the N = B + 1 tree indices (root = 0, parent -1)."""
    bs = tree.batch_size
    device = tree.tokens.device
    root_parent = torch.full((bs, 1), -1, dtype=torch.long, device=device)
    parents = torch.cat([root_parent, tree.parents + 1], dim=1)  # node parent -1 -> root 0
    depths = torch.cat([torch.zeros((bs, 1), dtype=torch.long, device=device), tree.depths], 1)
    return parents, depths


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[bs, N, N] bool, row i True on the ancestors of i and on i (parents: -1 at the root)."""
    bs, n = parents.shape
    idx = torch.arange(n, device=parents.device).expand(bs, n)
    step = torch.where(parents < 0, idx, parents)  # the root is its own parent
    anc = torch.zeros((bs, n, n), dtype=torch.bool, device=parents.device)
    cur = idx.clone()
    anc.scatter_(2, cur.unsqueeze(-1), True)
    for _ in range(max_depth):
        cur = step.gather(1, cur)
        anc.scatter_(2, cur.unsqueeze(-1), True)
    return anc


def sibling_links(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First child and next sibling of every tree index, both in increasing index order."""
    bs, n = parents.shape
    device = parents.device
    idx = torch.arange(n, device=device).expand(bs, n)
    # Sort by (parent, index); the root (parent -1) sorts first and has no siblings.
    key = (parents + 1) * n + idx
    order = torch.sort(key, dim=-1).indices
    sorted_par = parents.gather(1, order)
    same_next = torch.zeros_like(parents, dtype=torch.bool)
    same_next[:, :-1] = (sorted_par[:, 1:] == sorted_par[:, :-1]) & (sorted_par[:, :-1] >= 0)
    nxt = torch.full_like(order, -1)
    nxt[:, :-1] = torch.where(same_next[:, :-1], order[:, 1:], nxt[:, :-1])
    next_sibling = torch.full_like(parents, -1).scatter(1, order, nxt)
    # First child: the smallest child index of each parent.
    first_child = torch.full((bs, n + 1), n, dtype=torch.long, device=device)
    first_child.scatter_reduce_(1, (parents + 1).clamp(min=0), idx, reduce="amin")
    first_child = first_child[:, 1:]  # column p + 1 holds the children of p
    first_child = torch.where(first_child == n, torch.full_like(first_child, -1), first_child)
    return first_child, next_sibling


def build_verify_layout(tree: DraftTree, root_tokens: torch.Tensor, seq_lens: torch.Tensor,
                        max_depth: int | None = None) -> VerifyLayout:
    """Flatten a batch of trees for one verify pass (no host synchronisation).

    root_tokens: [bs] the bonus token of each request; seq_lens: [bs] committed lengths
    (tokens already in the target KV cache, not counting the root).
    """
    parents, depths = tree_parents_and_depths(tree)
    bs, n = parents.shape
    device = parents.device
    if max_depth is None:
        max_depth = n - 1
    draft_tokens = torch.cat([root_tokens.view(bs, 1).long(), tree.tokens], dim=1).reshape(-1)
    positions = (seq_lens.view(bs, 1).long() + depths).reshape(-1)
    first_child, next_sibling = sibling_links(parents)
    retrieve_index = torch.arange(bs * n, device=device).view(bs, n)
    return VerifyLayout(
        draft_tokens=draft_tokens,
        positions=positions,
        ancestors=ancestor_matrix(parents, max_depth),
        retrieve_index=retrieve_index,
        retrieve_next_token=first_child,
        retrieve_next_sibling=next_sibling,
        tree_parents=parents,
        tree_depths=depths,
    )


def truncate_layout(layout: VerifyLayout, width: int) -> VerifyLayout:
    """The layout of the first `width` - 1 nodes of every tree (root included: `width` tokens a
    request), sliced from a wider one without rebuilding it.

    Exact for the builder's best-first, prefix-closed trees (tree.builder.truncate_tree): every kept
    node's parent is kept, so the ancestors, positions and parents of the kept nodes do not
    change; a first child or next sibling past the cut becomes -1 (children and later siblings
    have larger indices), and the flat retrieve_index is renumbered for the new width."""
    bs, n = layout.tree_parents.shape
    if not 1 <= width <= n:
        raise ValueError(f"width must be in 1..{n} (the layout's width); got {width}")
    if width == n:
        return layout

    def cut(x: torch.Tensor) -> torch.Tensor:
        x = x[:, :width]
        return torch.where(x >= width, torch.full_like(x, -1), x)

    device = layout.tree_parents.device
    return VerifyLayout(
        draft_tokens=layout.draft_tokens.view(bs, n)[:, :width].reshape(-1),
        positions=layout.positions.view(bs, n)[:, :width].reshape(-1),
        ancestors=layout.ancestors[:, :width, :width].contiguous(),
        retrieve_index=torch.arange(bs * width, device=device).view(bs, width),
        retrieve_next_token=cut(layout.retrieve_next_token),
        retrieve_next_sibling=cut(layout.retrieve_next_sibling),
        tree_parents=layout.tree_parents[:, :width].contiguous(),
        tree_depths=layout.tree_depths[:, :width].contiguous(),
    )


def mask_positions(seq_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[bs, width, width] int64: where each request's ancestor block lands in full_mask's flat
    buffer (request r's block is width rows of seq_len + width, the tree block at the end of
    each row), from the device-side lengths alone: fixed shapes, so the tree stage computes it
    inside its CUDA graph and the verify's mask costs two ops on the host."""
    bs = seq_lens.shape[0]
    seq = seq_lens.long()
    row = seq + width  # row length of each request's block
    starts = torch.cumsum(width * row, 0) - width * row
    r = torch.arange(width, device=seq_lens.device)
    return (starts.view(bs, 1, 1) + r.view(1, width, 1) * row.view(bs, 1, 1)
            + seq.view(bs, 1, 1) + r.view(1, 1, width))


def full_mask(ancestors: torch.Tensor, seq_lens: torch.Tensor, seq_lens_sum: int,
              positions: torch.Tensor | None = None) -> torch.Tensor:
    """SGLang FULL_MASK: per request N x (seq_len + N), prefix visible, tree block = ancestors.

    `seq_lens_sum` sizes the buffer on the host without a sync; it may be an upper bound on
    sum(seq_lens) (the tail past the real blocks is never read).  Block offsets come from the
    device-side seq_lens, as the attention backends compute them: `positions`
    (mask_positions(seq_lens, N), e.g. from the tree stage), else computed here.
    """
    bs, n, _ = ancestors.shape
    mask = torch.ones(seq_lens_sum * n + bs * n * n, dtype=torch.bool, device=ancestors.device)
    if positions is None:
        positions = mask_positions(seq_lens, n)
    mask[positions.reshape(-1)] = ancestors.reshape(-1)
    return mask
