"""A draft tree the grammar allows: spend a constrained request's verify rows on continuations
its grammar accepts.

The drafter knows nothing of the grammar, so part of a best-first tree can be tokens the
grammar forbids at their prefix.  Such a node is never accepted (the target's choice there is
taken under the grammar's mask, so it never equals a forbidden token), and neither is anything
below it: its verify row is lost.  Given a candidate tree wider than the verify, the rows go
to the best grammar-valid nodes instead:

* `valid_nodes`: one depth-first walk of the candidate tree with the request's grammar matcher
  (`accept_token` + `rollback` per node, microseconds each): a node is valid when its token is
  accepted after its parent's path, which needs the parent valid.
* `select_nodes`: the root, then the valid nodes in best-first (index) order, then, where rows
  are left, invalid nodes whose parent is kept (fillers: the verify width is fixed); in
  ascending index order, so parents still come before children.
* `select_layout`: the verify layout of those nodes, gathered on the device from the candidate
  tree's layout (a parent-closed subset keeps its ancestor sub-matrix and positions).

Exactness is unchanged: the choice at every verified node is still the target's under that
node's grammar mask, and the acceptance walk follows those choices; only which candidate
nodes get verified changes.  Valid nodes in best-first order are the candidate tree's B best
grammar-valid prefixes, a prefix-closed set (a valid node's parent is valid and scores higher).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ddtree_sglang.grammar.masks import Matcher
from ddtree_sglang.tree.verify_layout import VerifyLayout, sibling_links


def children_lists(parents: Sequence[int]) -> list[list[int]]:
    """The children of every tree index (parents: -1 at the root), in index order."""
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p >= 0:
            kids[p].append(i)
    return kids


def valid_nodes(matcher: Matcher, parents: Sequence[int], tokens: Sequence[int]) -> list[bool]:
    """Per tree index (root 0, always valid): whether the node's path from the root is a
    continuation the grammar accepts.  The matcher is left in the state it came in."""
    kids = children_lists(parents)
    valid = [False] * len(parents)
    valid[0] = True
    stack = [(0, iter(kids[0]))]
    while stack:
        node, todo = stack[-1]
        child = next(todo, None)
        if child is None:
            stack.pop()
            if node != 0:
                matcher.rollback(1)
            continue
        if not matcher.is_terminated() and matcher.accept_token(int(tokens[child])):
            valid[child] = True
            stack.append((child, iter(kids[child])))
    return valid


def select_nodes(parents: Sequence[int], valid: Sequence[bool], width: int) -> list[int]:
    """The `width` tree indices a verify keeps (root first, ascending): the valid nodes in
    index order, then invalid nodes with a kept parent as fillers."""
    n = len(parents)
    if not 1 <= width <= n:
        raise ValueError(f"width must be in 1..{n} (the candidate tree's width); got {width}")
    kept = [i for i in range(n) if valid[i]][:width]
    chosen = set(kept)
    for i in range(1, n):
        if len(kept) == width:
            break
        if not valid[i] and parents[i] in chosen:
            kept.append(i)
            chosen.add(i)
    return sorted(kept)


def select_layout(layout: VerifyLayout, keep: torch.Tensor) -> VerifyLayout:
    """The layout of the nodes `keep` [bs, width] (ascending tree indices per row, root first,
    every kept node's parent kept) gathered from a candidate tree's `layout`, on its device."""
    bs, n = layout.tree_parents.shape
    width = keep.shape[1]
    device = layout.tree_parents.device
    keep = keep.to(device=device, dtype=torch.long)
    # old tree index -> new one (-1: dropped); the root maps to 0
    new_index = torch.full((bs, n), -1, dtype=torch.long, device=device)
    new_index.scatter_(1, keep, torch.arange(width, device=device).expand(bs, width))
    old_parents = layout.tree_parents.gather(1, keep)
    parents = torch.where(old_parents < 0, old_parents,
                          new_index.gather(1, old_parents.clamp(min=0)))
    rows = keep.unsqueeze(-1).expand(bs, width, n)
    ancestors = layout.ancestors.gather(1, rows).gather(
        2, keep.unsqueeze(1).expand(bs, width, width))
    first_child, next_sibling = sibling_links(parents)
    return VerifyLayout(
        draft_tokens=layout.draft_tokens.view(bs, n).gather(1, keep).reshape(-1),
        positions=layout.positions.view(bs, n).gather(1, keep).reshape(-1),
        ancestors=ancestors.contiguous(),
        retrieve_index=torch.arange(bs * width, device=device).view(bs, width),
        retrieve_next_token=first_child,
        retrieve_next_sibling=next_sibling,
        tree_parents=parents,
        tree_depths=layout.tree_depths.gather(1, keep),
    )
