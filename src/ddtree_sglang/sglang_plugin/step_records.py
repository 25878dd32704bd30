"""The records a DDTREE decode step passes from stage to stage (decode_step.DecodeStep):

    plan -> draft -> build tree -> verify -> sample and accept -> commit

Each stage takes the records before it and returns its own; none reads a tensor back to the
host.  The tensors' shapes are per step: bs requests, n = budget + 1 verify tokens each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ddtree_sglang.tree.stages import CommitSlots, StepCommit, VerifyLayout
from ddtree_sglang.sampling.penalties import PenaltyParams


@dataclass(frozen=True)
class StepPlan:
    """What this step verifies: bs requests, each a tree of `budget` nodes plus its root, from
    the relay state the previous step left (draft_input: its bonus tokens are the roots)."""

    bs: int
    budget: int
    draft_input: Any = None

    @property
    def width(self) -> int:
        return self.budget + 1


@dataclass(frozen=True)
class DraftedTree:
    """The build-tree stage's output.

    layout: the verify layout of the trees cut to the plan's budget.
    depth_probs [bs, K, depth]: the drafter's expected acceptance per candidate budget and
        depth (the batch-aware budget's statistics), None when the budget is pinned.
    grammar_tree: SGLang's GrammarTree of the layout (first child / next sibling / tokens),
        its host copy started before the verify launch; None when no request has a grammar.
    mask_positions [bs, n, n]: where the layout's ancestor blocks go in the verify's flat
        mask (verify_layout.mask_positions, from the tree stage), None where the stage did not
        compute this width's.
    """

    layout: VerifyLayout
    depth_probs: torch.Tensor | None
    grammar_tree: Any | None
    mask_positions: torch.Tensor | None = None


@dataclass(frozen=True)
class Verified:
    """The verify stage's output.

    logits_output: the target's LogitsProcessorOutput of the verify pass (hidden states for
        the draft KV; the logprob fields are filled at commit).
    logits [bs * n, V]: the target's raw logits at every node.  The sample-and-accept stage
        processes this buffer in place (no copy of bs * n x V) and hands the result on as
        Accepted.logits; read the processed values there, never here.
    grammar_step: the step's GrammarStep (grammar_stage.py): node masks built on the host while
        the verify pass runs and the greedy walks, None when no request has a grammar.
    out_cache_loc [bs * n]: the KV slots the verify wrote the nodes' K/V into.
    attn_backend: the target attention backend that ran the verify (the width's runtime; a
        hybrid target's recurrent state is committed through it).
    """

    logits_output: Any
    logits: torch.Tensor
    forward_batch: Any
    can_run_graph: bool
    grammar_step: Any | None
    out_cache_loc: torch.Tensor | None = None
    attn_backend: Any = None


@dataclass(frozen=True)
class Accepted:
    """The sample-and-accept stage's output: the target's choice at every node [bs, n], what
    the step commits and where it goes (computed with the walk), the batch's penalty settings
    (None: no request uses any) and the node
    logits as the choice saw them [bs * n, V] (grammar mask, penalties, logit bias applied;
    the committed tokens' logprobs are read off them)."""

    choice: torch.Tensor
    commit: StepCommit
    slots: CommitSlots
    penalties: PenaltyParams | None
    logits: torch.Tensor
