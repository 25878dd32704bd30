"""The DDTREE decode step: DFLASH's block draft turned into a tree, verified in one target pass.

`DecodeStep.run` begins (the batch's one change, the budget for this batch, the step clock),
runs four stages over the records of step_records.py, the verify inside its width's runtime
(`verify_runtime`), and ends (the budget's observation, the clock):

  draft and tree    the block [bonus, MASK x (bs-1)] through the drafter once; its CUDA graph
                    ends in the tree stage (graphed_stages.TreeStage): the drafter's full
                    distributions (through the target's lm_head) -> the B-best tree and its
                    verify layout at every candidate width, in fixed-address buffers; the step
                    takes the width of the budget chosen for this batch (serving_budget.py;
                    B when pinned);
  verify            root + B nodes in one TARGET_VERIFY pass through SGLang's EAGLE tree-mask
                    input (CUDA graphs captured with the mask, see plugin.py); while it runs,
                    the host builds the grammar's node masks (structured output,
                    grammar_stage.py);
  sample and accept each node's logits get the request's grammar mask and penalties as plain
                    decoding would apply them there; the target's choice at every node
                    (argmax when greedy) goes straight into the accept stage's input buffer;
                    greedy constrained requests may walk their grammar along the accepted path
                    instead of masking every node; the accept stage's graph walks the tree and
                    computes everything the commit needs, into a two-slot ring;
  commit            a hybrid target's recurrent state of the last accepted node committed,
                    the accepted nodes' target KV moved to the committed positions, their
                    hidden states into the draft KV, and the committed tokens' logprobs read
                    off the same node logits when asked.
No stage reads tensors back to the host, except in steps with a grammar: the grammar walks
(SGLANG_DDTREE_GRAMMAR path or auto, in steps where a constrained request walks) read the
target's top-K per node (greedy) or each depth's draws (sampled).  Each stage runs inside
SGLang's profiler span of its name, so a trace names it.  The step reaches the models and
DFLASH's buffers only through `io` (model_io.py); worker.py builds it and captures its graphs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

from ddtree_sglang.tree.stages import StepCommit, penalise_nodes
from ddtree_sglang.sampling.logprobs import committed_log_probs
from ddtree_sglang.sampling.sample import sample_rows
from ddtree_sglang.sglang_plugin import patches, sglang_api as sg
from ddtree_sglang.sglang_plugin.serving_budget import ServingBudget
from ddtree_sglang.sglang_plugin.grammar_stage import (MaskCosts, grammar_choices,
                                                      grammar_spines,
                                                      sampled_grammar_choices,
                                                      start_grammar_step)
from ddtree_sglang.sglang_plugin.host_timing import NoClock, StageClock
from ddtree_sglang.sglang_plugin.model_io import ModelIO
from ddtree_sglang.sglang_plugin.request_state import PenaltyState, request_seeds
from ddtree_sglang.sglang_plugin.settings import DDTreeSettings
from ddtree_sglang.sglang_plugin.step_records import Accepted, DraftedTree, StepPlan, Verified
from ddtree_sglang.sglang_plugin.graphed_stages import GraphedStages


def sample_for_requests(logits: torch.Tensor, sampling_info, req_index: torch.Tensor,
                        seeds: torch.Tensor | None = None,
                        positions: torch.Tensor | None = None) -> torch.Tensor:
    """[rows] the target's choice for each row of `logits` [rows, V], row r with request
    req_index[r]'s settings: argmax, or one draw from the filtered distribution
    (ddtree_sglang.sampling.sample, joint top-k/top-p, with sgl_kernel's renorm kernels; rows of
    seeded requests draw as a function of (seed, the row's node position))."""
    if sampling_info is None or sampling_info.is_all_greedy:
        return logits.argmax(dim=-1)

    def pick(x):
        return x.index_select(0, req_index)

    si = sampling_info
    return sample_rows(
        logits, pick(si.temperatures), pick(si.top_ks) if si.need_top_k_sampling else None,
        pick(si.top_ps) if si.need_top_p_sampling else None,
        pick(si.min_ps) if si.need_min_p_sampling else None,
        top_k_renorm=sg.top_k_renorm_prob, top_p_renorm=sg.top_p_renorm_prob,
        seeds=None if seeds is None else pick(seeds), positions=positions)


def sample_per_node(logits: torch.Tensor, sampling_info, n: int,
                    seeds: torch.Tensor | None = None,
                    positions: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """[bs * n] the target's choice at every node of [bs * n, V] logits (greedy: written into
    `out` where given, the accept stage's input buffer)."""
    if sampling_info is None or sampling_info.is_all_greedy:  # no per-row settings to gather
        return torch.argmax(logits, dim=-1, out=out)
    req_index = torch.arange(logits.shape[0] // n, device=logits.device).repeat_interleave(n)
    return sample_for_requests(logits, sampling_info, req_index, seeds, positions)


class DecodeStep:
    """One DDTREE decode step over a running batch, built from what it uses: the settings,
    the vocabulary size, the model I/O, the tree and accept stages (graphed by startup), the
    penalty and grammar-cost state kept across steps, the batch-aware budget (None: B pinned)
    and the host clock."""

    def __init__(self, settings: DDTreeSettings, vocab_size: int, io: ModelIO,
                 stages: GraphedStages, penalties: PenaltyState, mask_costs: MaskCosts,
                 serving_budget: ServingBudget | None = None,
                 clock: StageClock | NoClock | None = None) -> None:
        self.settings, self.vocab_size, self.io, self.stages = settings, vocab_size, io, stages
        self.penalties, self.mask_costs, self.serving_budget = penalties, mask_costs, serving_budget
        self.clock = clock or NoClock()
        self.depth, self.out_width = settings.depth, settings.block_size

    def run(self, batch, on_publish: Callable | None = None, grammar_barrier=None):
        """The decode step: its four stages in order, each taking the records before it."""
        plan = self.begin_step(batch)
        with sg.stage_span("ddtree_draft_tree"):
            tree = self.draft_tree(batch, plan, grammar_barrier)
        self.clock.mark("draft + tree")
        with self.verify_runtime(plan.width), sg.stage_span("ddtree_verify"):
            verified = self.verify(batch, plan, tree, grammar_barrier)
        self.clock.mark("verify")
        with sg.stage_span("ddtree_sample_accept"):
            accepted = self.sample_and_accept(batch, plan, tree, verified)
        self.clock.mark("sample + accept")
        with sg.stage_span("ddtree_commit"):
            result = self.commit(batch, plan, tree, verified, accepted, on_publish)
        self.clock.mark("commit")
        self.end_step(plan, tree, verified, accepted)
        return result

    def begin_step(self, batch) -> StepPlan:
        """The step's plan (batch size, budget, the relay state it starts from); starts the
        step clock and the budget controller's step.  The one place the step itself changes
        the batch it is given: seq_lens clamped (below).  Two more writes happen where SGLang's
        conventions put them, each through patches.py: its verify preparation's fields
        (model_io.DFlashModelIO.target_verify; no stage reads them back: the tree's KV slots
        travel in Verified) and the reset of sampling_info.grammar_mask, which would otherwise
        carry the prefill's mask into the step (grammar_stage.start_grammar_step)."""
        draft_input = batch.spec_info
        if not isinstance(draft_input, sg.DFlashDraftInputV2):
            raise RuntimeError("DDTREE expected DFlashDraftInputV2 state on the running batch")
        if batch.seq_lens.is_cuda:  # made on the scheduler's stream, used on this one
            batch.seq_lens.record_stream(torch.cuda.current_stream())
        bs = len(batch.seq_lens)
        self.clock.start(bs)
        # A request that already finished on the GPU can get one more step under overlap
        # scheduling; keep its writes inside its own row (see draft_input.py).  A running
        # request is never clamped.  (The KV reservation is always the largest width's.)
        patches.clamp_seq_lens(batch, self.io.max_step_seq_len())
        serving_budget = self.serving_budget
        budget = self.settings.budget if serving_budget is None else serving_budget.choose(bs)
        if serving_budget is not None:
            serving_budget.start_step(bs, budget)
        return StepPlan(bs=bs, budget=budget, draft_input=draft_input)

    def end_step(self, plan: StepPlan, tree: DraftedTree, verified: Verified,
                 accepted: Accepted) -> None:
        """The budget controller learns what the step committed (and each request's budget
        is reported when traced); the step clock stops."""
        if self.serving_budget is not None:
            self.serving_budget.observe(plan.bs, plan.budget, tree.depth_probs,
                                          accepted.commit.commit_lens)
            patches.report_per_request(verified.logits_output, "ddtree_budget",
                                       [plan.budget] * plan.bs)
        self.clock.end()

    @contextmanager
    def verify_runtime(self, width: int):
        """The target verifies through `width`'s attention backend and CUDA graphs (the
        batch-aware budget's), and everything else through the configured width's again
        afterwards, also when the verify fails."""
        runner = self.io.target_runner
        configured = sg.verify_runtime(runner)
        if self.serving_budget is not None:
            patches.set_verify_runtime(runner, self.serving_budget.runtimes[width])
        try:
            yield
        finally:
            patches.set_verify_runtime(runner, configured)

    def draft_tree(self, batch, plan: StepPlan, grammar_barrier=None) -> DraftedTree:
        """One drafter pass over [bonus, MASK...] for every request, whose CUDA graph ends in
        the tree stage (a budget of 0 drafts nothing: the roots alone, plain decoding through
        the same verify); the tree stage runs here instead where the pass ran eagerly, and where
        constrained requests' trees are rooted in what their grammar forces
        (SGLANG_DDTREE_GRAMMAR_FORCE=spine, once the grammars hold the previous step's tokens:
        `grammar_barrier`).  The trees cut to the plan's width; with a grammar in the batch,
        the host copy of the tree that the bitmask needs starts here, before the verify."""
        stage = self.stages.tree
        if plan.budget == 0:  # no speculation: nothing drafted, the root alone verifies
            stage.run_root(plan.draft_input.bonus_tokens, batch.seq_lens)
        else:
            spine = batch.has_grammar and self.settings.grammar_force == "spine"
            if spine and grammar_barrier is not None:
                grammar_barrier()  # the grammars hold the previous step's tokens
            hidden, tree_ready = self.io.draft_block(batch, plan.draft_input)
            if spine or not tree_ready:
                forced = grammar_spines(batch.reqs, self.depth, hidden.device) if spine else None
                stage.run(hidden[:, 1:, :], plan.draft_input.bonus_tokens, batch.seq_lens,
                          forced)
        out = stage.read(plan.bs)
        layout = out.layouts[plan.width]
        grammar_tree = None
        if batch.has_grammar:
            grammar_tree = sg.GrammarTree.from_device(
                retrieve_next_token=layout.retrieve_next_token,
                retrieve_next_sibling=layout.retrieve_next_sibling,
                draft_token=layout.draft_tokens.view(plan.bs, plan.width))
        return DraftedTree(layout=layout, grammar_tree=grammar_tree,
                           depth_probs=out.depth_probs if plan.budget > 0 else None,
                           mask_positions=out.mask_positions.get(plan.width))

    def verify(self, batch, plan: StepPlan, tree: DraftedTree, grammar_barrier) -> Verified:
        """The target's pass over every tree node (through the runtime the pipeline set, see
        verify_runtime), and the grammar's part of the step, built on the host while that
        pass runs."""
        logits_output, forward_batch, can_run_graph, slots = self.io.target_verify(
            batch, plan.draft_input, tree.layout, tree.mask_positions,
            self.stages.tree.mask_buffer(plan.width, plan.bs))
        sg.detect_nan(logits_output.next_token_logits, "DDTREE verify logits")
        grammar_step = None
        if tree.grammar_tree is not None:
            grammar_step = start_grammar_step(batch, tree.grammar_tree, plan.width, grammar_barrier,
                                         logits_output.next_token_logits.device,
                                         self.settings.grammar_method, self.mask_costs)
        return Verified(logits_output=logits_output, logits=logits_output.next_token_logits,
                        forward_batch=forward_batch, can_run_graph=can_run_graph,
                        grammar_step=grammar_step, out_cache_loc=slots,
                        attn_backend=self.io.target_runner.attn_backend)

    def sample_and_accept(self, batch, plan: StepPlan, tree: DraftedTree,
                          verified: Verified) -> Accepted:
        """Each node's logits processed as plain decoding would at that node (grammar mask,
        the request's penalties with the node's own path, logit bias), one target choice per
        node, and the walk along them."""
        bs, n, lay = plan.bs, plan.width, tree.layout
        logits = verified.logits
        grammar_step = verified.grammar_step
        if grammar_step is not None and grammar_step.mask is not None:
            grammar_step.mask.apply(logits)
        penalties = self.penalties.params(batch.reqs)
        if penalties is not None:
            counts, out_len = self.penalties.rows_of(batch.req_pool_indices)
            penalise_nodes(logits.view(bs, n, -1)[..., : self.vocab_size], counts, out_len,
                           penalties, lay.draft_tokens.view(bs, n), lay.tree_parents,
                           lay.tree_depths, self.depth)
        sg.apply_dflash_verify_logits_adjustments(
            next_token_logits=logits, sampling_info=batch.sampling_info, draft_token_num=n)
        seeds = request_seeds(batch.reqs, logits.device)
        choice_in, verify_slots = self.stages.accept.inputs(bs, n)
        choice = sample_per_node(logits, batch.sampling_info, n, seeds, lay.positions,
                                 out=choice_in.view(-1)).view(bs, n)
        choice = grammar_choices(grammar_step, logits, choice, n, self.vocab_size,
                                 self.mask_costs)

        def sample(rows: torch.Tensor, req_rows: list[int], nodes: list[int]) -> torch.Tensor:
            index = torch.tensor(req_rows, dtype=torch.long, device=rows.device)
            flat = index * n + torch.tensor(nodes, dtype=torch.long, device=rows.device)
            return sample_for_requests(rows, batch.sampling_info, index, seeds,
                                       lay.positions.index_select(0, flat))

        choice = sampled_grammar_choices(grammar_step, logits, choice, n, self.vocab_size,
                                         sample, self.mask_costs)
        if choice.data_ptr() != choice_in.data_ptr():  # sampled or walked: a tensor of its own
            choice_in.copy_(choice)
        verify_slots.copy_(verified.out_cache_loc)
        simulated = self.stages.accept.simulated
        if simulated is not None:  # a forced acceptance: this step's length, drawn at its budget
            self.stages.accept.forced_len.fill_(sg.simulated_commit_len(
                simulated.tau(n - 1), min(n, self.out_width)))
        commit, slots = self.stages.accept.run(bs, n)
        return Accepted(choice=choice_in, commit=commit, slots=slots, penalties=penalties,
                        logits=logits)

    def commit(self, batch, plan: StepPlan, tree: DraftedTree, verified: Verified,
               accepted: Accepted, on_publish):
        """A hybrid target's recurrent state of each last accepted node (while the lengths are
        still the step's), the new lengths published (the scheduler plans the next batch
        while the GPU runs the rest, as SGLang's spec-v2 workers publish before their draft
        extend), then the accepted path's KV to its committed positions, its target features
        into the draft KV, the committed tokens' logprobs; the step's result."""
        step, slots = accepted.commit, accepted.slots
        self.io.commit_recurrent_state(verified.attn_backend, batch, step, plan.width)
        new_seq_lens = slots.new_seq_lens
        if on_publish is not None:
            on_publish(new_seq_lens)
        if accepted.penalties is not None:
            self.penalties.commit(batch.req_pool_indices, step.tokens, step.commit_lens)
        self.io.move_accepted_kv(batch, step, slots)
        self.io.append_committed_features(verified.logits_output, step, slots)
        if batch.return_logprob:
            self.add_logprobs(batch, verified.logits_output, accepted.logits, step)
        return sg.GenerationBatchResult(
            logits_output=verified.logits_output,
            next_token_ids=step.tokens.reshape(-1),
            accept_lens=step.commit_lens,
            can_run_cuda_graph=verified.can_run_graph,
            next_draft_input=self.io.next_draft_input(step.bonus, new_seq_lens),
            # SGLang's name for the row width of next_token_ids ([bs, out_width], the draft
            # block); the worker's own speculative_num_draft_tokens is the verify width B + 1
            speculative_num_draft_tokens=self.out_width,
            new_seq_lens=new_seq_lens,
            extra_keep_alive_refs=[verified.forward_batch],
        )

    def add_logprobs(self, batch, out, logits: torch.Tensor, step: StepCommit) -> None:
        """The committed tokens' logprobs (and top / token-id logprobs when asked), read off
        the processed node `logits` as plain decoding reads them, into the logits output `out`
        in the layout SGLang's spec-v2 result processing reads: [bs, W] and bs * W rows."""
        si = batch.sampling_info
        temperatures = None if si is None or si.is_all_greedy or \
            sg.RETURN_ORIGINAL_LOGPROB else si.temperatures
        row_lp, token_lp = committed_log_probs(logits[:, : self.vocab_size],
                                               step.feature_rows, step.tokens, temperatures)
        width = self.out_width
        top = token_ids = None
        if batch.top_logprobs_nums and any(k > 0 for k in batch.top_logprobs_nums):
            top = sg.get_top_logprobs(
                row_lp, [k for k in batch.top_logprobs_nums for _ in range(width)],
                no_copy_to_cpu=True)
        if batch.token_ids_logprobs and any(t is not None for t in batch.token_ids_logprobs):
            token_ids = sg.get_token_ids_logprobs(
                row_lp, [t for t in batch.token_ids_logprobs for _ in range(width)],
                no_copy_to_cpu=True)
        patches.set_output_logprobs(out, token_lp, top, token_ids)
