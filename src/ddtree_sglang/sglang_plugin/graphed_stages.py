"""The decode step's two fixed-shape GPU stages, each a GraphedFunction: the tree stage
(drafter states -> B-best tree -> verify layout) and the accept stage (target choices -> what
the step commits).  worker.py captures them per decode batch size; the step calls them."""

from __future__ import annotations

from typing import Callable

import torch

from ddtree_sglang.tree.stages import commit_stage, stage_widths, tree_stage
from ddtree_sglang.grammar.forcing import force_draft_logits
from ddtree_sglang.kernels.graphed import GraphedFunction
from ddtree_sglang.kernels.choice import Kernels


class GraphedStages:
    """`tree(draft_hidden, roots, seq_lens[, forced])` and `accept(tokens, parents, depths, choice,
    out_cache_loc, seq_lens)` (the walk and the commit's slots: step_ops.commit_stage).

    draft_logits: [bs, L, H] drafter states -> [bs, L, V] logits (the target's lm_head);
    budgets: the batch-aware budget's candidate widths (the tree stage also computes their
    expected acceptance), or one budget when B is pinned; graphed: capture CUDA graphs."""

    def __init__(self, kernels: Kernels, budget: int, depth: int, out_width: int,
                 draft_logits: Callable[[torch.Tensor], torch.Tensor],
                 budgets: tuple[int, ...] = (), graphed: bool = True) -> None:
        self.kernels, self.budget, self.depth, self.out_width = kernels, budget, depth, out_width
        self.draft_logits = draft_logits
        self.candidates = tuple(budgets) if len(budgets) > 1 else ()
        self.widths = stage_widths(budget, self.candidates)  # mask positions computed for these
        self.tree = GraphedFunction(self._tree, "DDTREE tree stage", graphed)
        self.accept = GraphedFunction(self._accept, "DDTREE accept stage", graphed)

    def _tree(self, draft_hidden, roots, seq_lens, forced=None) -> tuple:
        """Drafter states -> B-best tree -> verify layout (fixed shapes; CUDA-graphed);
        `forced` [bs, depth] (-1: none): the grammar's forced spine (grammar_forcing.py), a
        graph of its own per batch size."""
        logits = self.draft_logits(draft_hidden)
        if forced is not None:
            logits = force_draft_logits(logits, forced)
        return tree_stage(logits, roots, seq_lens, self.budget, self.depth,
                          self.kernels.build_tree, self.candidates)

    def _accept(self, tokens, parents, depths, choice, out_cache_loc, seq_lens) -> tuple:
        """Target choices -> StepCommit and CommitSlots fields (fixed shapes; CUDA-graphed)."""
        return commit_stage(self.kernels.accept_stage, tokens, parents, depths, choice,
                            out_cache_loc, seq_lens, self.depth, self.out_width)

    def disable_graphs(self) -> None:
        self.tree.enabled = self.accept.enabled = False

    def freeze(self) -> None:
        self.tree.freeze()
        self.accept.freeze()
