"""The decode step's two fixed-shape GPU stages, and the fixed-address buffers they leave their
results in: the step reads views of them and copies nothing in or out of a graph.

Tree stage (tree/stages.tree_stage): drafter states -> the B-best tree's verify layout at every
candidate width, the mask positions, the candidates' expected acceptance and the lengths.  Where
SGLang captures the drafter's CUDA graphs it runs inside them, after the drafter's last layer:
`TreeStage.tail_hook` is a capture tail hook of the draft model runner (the mechanism DFLASH
uses to fold its draft sampler into the same graph), writing into `TreeStage.out`, and writing
each width's ancestor blocks straight into that width's target attention backend's verify-mask
buffer (`set_mask_targets`), where SGLang's Triton backend reads them: the verify builds no
mask and copies none (EAGLE fills the same buffer in place after its draft).  A draft forward
that ran eagerly, and a step whose trees a grammar's forced spine roots, run it through
`TreeStage.run` into the same buffers.

Accept stage (tree/stages.commit_stage): the target's choices -> StepCommit and CommitSlots.  A
CUDA graph per (batch size, verify width, ring slot) reads the tree buffers, its own choice and
verify-slot buffers (the step writes the choices there directly) and writes into a two-slot
ring, so that step k's results stay valid while step k + 1 runs (overlap scheduling reads them
after), as DFLASH's rotating accept buffers do.  Batch sizes without a graph run it eagerly.

A graph of a larger batch size serves a smaller batch: its rows past the batch compute on stale
but well-formed buffer contents (buffers start as a complete sample and only ever hold complete
trees, token ids and KV slots) and are never read; nothing in either graph writes outside its
own buffers.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from ddtree_sglang.grammar.forcing import force_draft_logits
from ddtree_sglang.kernels.choice import Kernels
from ddtree_sglang.kernels.graphed import GraphedFunction, capture_graph
from ddtree_sglang.sglang_plugin import patches
from ddtree_sglang.tree.acceptance import SimulatedAcceptance
from ddtree_sglang.tree.verify_layout import mask_positions
from ddtree_sglang.tree.stages import (CommitSlots, StepCommit, TreeStageOutput, commit_stage,
                                       forced_accept_stage, stage_widths, tree_stage,
                                       unpack_commit_stage, unpack_tree_stage, verify_widths)

logger = logging.getLogger(__name__)
SAMPLE_BS = 2  # the batch size the buffers' shapes are read from


class StaticOutputs:
    """Fixed-address tensors for the outputs of a fixed-shape function whose leading dimension
    is the batch, or the batch times a fixed number of rows per request, for up to `max_bs`
    requests; `sample`: the function's outputs at SAMPLE_BS requests.  Every request's rows
    start as the sample's first request's, so the buffers hold well-formed outputs (complete
    trees) before any write: a padded graph replay may read rows no step wrote."""

    def __init__(self, sample: Sequence[torch.Tensor], max_bs: int) -> None:
        self.max_bs = max_bs
        self.rows = tuple(t.shape[0] // SAMPLE_BS for t in sample)
        self.buffers = tuple(t[:r].repeat(max_bs, *([1] * (t.dim() - 1))).contiguous()
                             for r, t in zip(self.rows, sample))

    def write(self, outputs: Sequence[torch.Tensor], bs: int) -> None:
        """The outputs of a `bs`-request call into the buffers' first rows."""
        if bs > self.max_bs:
            raise ValueError(f"a batch of {bs} requests exceeds the {self.max_bs} the step's "
                             "buffers hold")
        for buf, r, t in zip(self.buffers, self.rows, outputs):
            buf[: bs * r].copy_(t)

    def read(self, bs: int) -> tuple[torch.Tensor, ...]:
        """Views of the first `bs` requests' rows (what the last write or replay left)."""
        return tuple(buf[: bs * r] for buf, r in zip(self.buffers, self.rows))


class TreeStage:
    """drafter states [bs, depth, H] -> TreeStageOutput, in the draft graph's tail or through
    `run`; results in `out`.  draft_logits: [bs, L, H] -> [bs, L, V] (the target's lm_head);
    budgets: the batch-aware budget's candidates ending with B (one entry: B pinned)."""

    def __init__(self, kernels: Kernels, budget: int, depth: int,
                 draft_logits: Callable[[torch.Tensor], torch.Tensor], budgets: Sequence[int],
                 max_bs: int, hidden_size: int, dtype: torch.dtype, device,
                 graphed: bool = True) -> None:
        self.kernels, self.budget, self.depth = kernels, budget, depth
        self.draft_logits = draft_logits
        self.candidates = tuple(budgets) if len(budgets) > 1 else ()
        self.widths = verify_widths(budget, self.candidates)
        self.block = depth + 1
        # The eager path's function, graphed per batch size (and per spine input) at startup.
        self.graphed = GraphedFunction(self._tree, "DDTREE tree stage", graphed)
        sample = self._tree(torch.zeros(SAMPLE_BS, depth, hidden_size, dtype=dtype,
                                        device=device),
                            torch.zeros(SAMPLE_BS, dtype=torch.long, device=device),
                            torch.ones(SAMPLE_BS, dtype=torch.long, device=device))
        self.out = StaticOutputs(sample, max(max_bs, SAMPLE_BS))
        self._views: dict[int, TreeStageOutput] = {}
        self.mask_targets: dict[int, tuple[torch.Tensor, int]] = {}

    def set_mask_targets(self, targets: dict[int, tuple[torch.Tensor, int]]) -> None:
        """width -> (a target backend's flat verify-mask buffer, the most requests it holds):
        the stage writes each width's ancestor blocks there (only the blocks: the backends
        that take such a buffer never read a mask's prefix part).  Set before the draft graphs
        are captured; only widths whose mask positions the stage computes."""
        placed = stage_widths(self.budget, self.candidates)
        self.mask_targets = {w: target for w, target in targets.items() if w in placed}

    def mask_buffer(self, width: int, bs: int) -> torch.Tensor | None:
        """The backend buffer holding this step's mask at `width`, or None (the verify then
        builds the mask)."""
        target = self.mask_targets.get(width)
        return target[0] if target is not None and bs <= target[1] else None

    def _write_masks(self, outputs: tuple, bs: int) -> None:
        out = unpack_tree_stage(outputs, self.budget, self.candidates)
        for width, (buffer, max_bs) in self.mask_targets.items():
            if bs <= max_bs:
                patches.write_mask_blocks(buffer, out.mask_positions[width],
                                          out.layouts[width].ancestors)

    def _tree(self, draft_hidden: torch.Tensor, roots: torch.Tensor, seq_lens: torch.Tensor,
              forced: torch.Tensor | None = None) -> tuple:
        logits = self.draft_logits(draft_hidden)
        if forced is not None:  # [bs, depth], -1: none (grammar/forcing.py)
            logits = force_draft_logits(logits, forced)
        return tree_stage(logits, roots, seq_lens, self.budget, self.depth,
                          self.kernels.build_tree, self.candidates)

    def tail_hook(self, runner, out, forward_batch, num_tokens: int) -> None:
        """A capture tail hook of SGLang's draft model runner (model_runner.capture_tail_hooks):
        runs once per captured draft graph, after the drafter, inside the capture.  The block's
        first token is each request's root (the bonus token); the draft graph's lengths are the
        committed ones."""
        del runner
        hidden = getattr(out, "hidden_states", None)
        if hidden is None:
            raise RuntimeError("DDTREE: the draft forward captured no hidden states for the "
                               "tree stage")
        bs = num_tokens // self.block
        roots = forward_batch.input_ids.view(bs, self.block)[:, 0].long()
        states = hidden.view(bs, self.block, -1)[:, 1:, :]
        outputs = self._tree(states, roots, forward_batch.seq_lens[:bs].long())
        self.out.write(outputs, bs)
        self._write_masks(outputs, bs)

    def run(self, draft_hidden: torch.Tensor, roots: torch.Tensor, seq_lens: torch.Tensor,
            forced: torch.Tensor | None = None) -> None:
        """The stage outside the draft graph, into `out` (a draft forward that ran eagerly, a
        forced spine)."""
        inputs = (draft_hidden, roots.long(), seq_lens.long())
        outputs = self.graphed(*inputs, *(() if forced is None else (forced,)))
        self.out.write(outputs, draft_hidden.shape[0])
        self._write_masks(outputs, draft_hidden.shape[0])

    def run_root(self, roots: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """A step without a draft (budget 0, no speculation): each request's root alone, the
        width-1 layout, into the same buffers (the accept stage reads it there).  Every other
        field of a width-1 layout is the same for any tree (no children, no parent, depth 0)
        and already in the buffers; only the roots, their positions and the lengths change."""
        bs = roots.shape[0]
        out = self.read(bs)
        root = out.layouts[1]
        root.draft_tokens.copy_(roots)
        root.positions.copy_(seq_lens)
        out.seq_lens.copy_(seq_lens)
        if 1 in out.mask_positions:
            out.mask_positions[1].copy_(mask_positions(seq_lens, 1))
            target = self.mask_targets.get(1)
            if target is not None and bs <= target[1]:
                patches.write_mask_blocks(target[0], out.mask_positions[1], root.ancestors)

    def read(self, bs: int) -> TreeStageOutput:
        """The results of the last `bs`-request call, as views of the buffers (the same view
        objects every time: the step takes them with no tensor op)."""
        views = self._views.get(bs)
        if views is None:
            views = self._views[bs] = unpack_tree_stage(self.out.read(bs), self.budget,
                                                        self.candidates)
        return views


class AcceptStage:
    """The target's choices -> (StepCommit, CommitSlots) over the tree stage's buffers; the
    step writes each node's choice and KV slot into `inputs(bs, width)` and calls `run`."""

    def __init__(self, kernels: Kernels, tree: TreeStage, out_width: int,
                 graphed: bool = True, simulated: SimulatedAcceptance | None = None) -> None:
        self.kernels, self.tree, self.out_width = kernels, tree, out_width
        self.enabled, self.frozen = graphed, False
        rows = tree.out.max_bs * max(tree.widths)
        device = tree.out.buffers[0].device
        self.choice = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.zeros(rows, dtype=torch.long, device=device)
        # A forced acceptance (sglang_api.simulated_acceptance): the walk commits the length
        # the step writes into `forced_len`, along the tree's best path.
        self.simulated = simulated
        self.forced_len = torch.ones(tree.out.max_bs, dtype=torch.long, device=device)
        self._walk = kernels.accept_stage if simulated is None else forced_accept_stage(
            self.forced_len, 100 if simulated.token_mode == "fixed" else None)
        # Views handed to the step, made once per shape: (bs, width[, slot]) -> views.
        self._inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._outputs: dict[tuple[int, int, int], tuple[StepCommit, CommitSlots]] = {}
        self._padded: dict[tuple[int, int, int], int | None] = {}
        # The ring per verify width (a narrow verify moves fewer KV rows): width -> 2 slots.
        self.ring = {w: tuple(StaticOutputs(self._accept(SAMPLE_BS, w), tree.out.max_bs)
                              for _ in range(2)) for w in tree.widths}
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._slot = 0

    def inputs(self, bs: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([bs, width] choice, [bs * width] KV slots): where the step writes this step's
        target choices and verify slots (the same view objects every time)."""
        views = self._inputs.get((bs, width))
        if views is None:
            views = self._inputs[(bs, width)] = (self.choice[: bs * width].view(bs, width),
                                                 self.slots[: bs * width])
        return views

    def _accept(self, bs: int, width: int) -> tuple:
        tree = self.tree.read(bs)
        lay = tree.layouts[width]
        choice, slots = self.inputs(bs, width)
        return commit_stage(self._walk, lay.draft_tokens.view(bs, width),
                            lay.tree_parents, lay.tree_depths, choice, slots.view(bs, width),
                            tree.seq_lens, self.tree.depth, self.out_width)

    def run(self, bs: int, width: int) -> tuple[StepCommit, CommitSlots]:
        """The walk and the commit's slots of this step's `bs` requests at `width`."""
        slot, self._slot = self._slot, self._slot ^ 1
        key = (bs, width, slot)
        padded = self._padded.get(key, -1) if self.frozen else self._captured_size(*key)
        if padded == -1:
            padded = self._padded[key] = self._captured_size(*key)
        if padded is None:
            return unpack_commit_stage(self._accept(bs, width))
        self._graphs[(padded, width, slot)].replay()
        outputs = self._outputs.get(key)
        if outputs is None:
            outputs = self._outputs[key] = unpack_commit_stage(self.ring[width][slot].read(bs))
        return outputs

    def _captured_size(self, bs: int, width: int, slot: int) -> int | None:
        """The smallest captured batch size >= bs of this width and slot, or None."""
        if not self.enabled:
            return None
        if (bs, width, slot) in self._graphs:
            return bs
        sizes = [s for (s, w, r) in self._graphs if w == width and r == slot and s > bs]
        return min(sizes) if sizes else None

    def capture(self, sizes: Sequence[int]) -> None:
        """A graph per batch size of `sizes`, verify width and ring slot, largest first (the
        shared pool is sized once)."""
        for bs in sorted(set(sizes), reverse=True):
            for width in self.tree.widths:
                for slot in range(2):
                    def step(bs=bs, width=width, slot=slot) -> None:
                        self.ring[width][slot].write(self._accept(bs, width), bs)

                    self._pool = self._pool or torch.cuda.graph_pool_handle()
                    self._graphs[(bs, width, slot)] = capture_graph(step, self._pool)

    @property
    def captured_sizes(self) -> list[int]:
        return sorted({s for (s, _, _) in self._graphs})


class GraphedStages:
    """The tree and accept stages of one worker (see the module docstring)."""

    def __init__(self, kernels: Kernels, budget: int, depth: int, out_width: int,
                 draft_logits: Callable[[torch.Tensor], torch.Tensor],
                 budgets: Sequence[int] = (), max_bs: int = 64, hidden_size: int = 0,
                 dtype: torch.dtype = torch.float32, device="cpu", graphed: bool = True,
                 simulated: SimulatedAcceptance | None = None) -> None:
        self.tree = TreeStage(kernels, budget, depth, draft_logits, tuple(budgets) or (budget,),
                              max_bs, hidden_size, dtype, device, graphed)
        self.accept = AcceptStage(kernels, self.tree, out_width, graphed, simulated)
        self.widths = self.tree.widths

    def disable_graphs(self) -> None:
        self.tree.graphed.enabled = self.accept.enabled = False

    def freeze(self) -> None:
        self.tree.graphed.freeze()
        self.accept.frozen = True
