"""DDTreeWorker: SGLang's DFlash worker with the linear verify replaced by a draft tree.

Target hidden-state capture, draft-KV materialisation and the one-pass block draft are
DFlashWorkerV2's.  A decode step (forward_batch_generation) begins (_begin_step: the batch's
one change, the budget for this batch, the step clock), runs five stages over the records of
step_records.py, the verify inside its width's runtime (_verify_runtime), and ends (_end_step:
the budget controller's observation, the clock):

  draft             the block [bonus, MASK x (bs-1)] through the drafter once;
  build tree        the drafter's full distributions (through the target's lm_head) -> the
                    B-best tree, its verify layout and mask (ddtree_sglang core), cut to the
                    budget chosen for this batch (adaptive_budget.py; B when pinned);
  verify            root + B nodes in one TARGET_VERIFY pass through SGLang's EAGLE tree-mask
                    input (CUDA graphs captured with the mask, see plugin.py); while it runs,
                    the host builds the grammar's node masks (structured output,
                    grammar_stage.py);
  sample and accept each node's logits get the request's grammar mask and penalties as plain
                    decoding would apply them there; the target samples once per node (argmax
                    when greedy), greedy constrained requests may walk their grammar along the
                    accepted path instead of masking every node, and the tree is walked along
                    the choices (core);
  commit            the accepted nodes' target KV moves to the committed positions, their
                    hidden states enter the draft KV, and the committed tokens' logprobs are
                    read off the same node logits when asked.
No stage reads tensors back to the host, except the greedy grammar walk (SGLANG_DDTREE_GRAMMAR
path or auto, in steps where a greedy constrained request walks), which reads the target's
top-K per node.
Prefill is DFLASH's, run here so that requests with logprobs are served too.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import replace

import torch

from ddtree_sglang.decode_step import (StepCommit, commit_slots, kv_moves, penalise_nodes,
                                       tree_stage, truncate_layout, unpack_tree_stage,
                                       verify_mask)
from ddtree_sglang.graphed import GraphedFunction
from ddtree_sglang.kernel_choice import Kernels, choose_kernels
from ddtree_sglang.logprobs import committed_log_probs
from ddtree_sglang.sampling import sample_rows
from ddtree_sglang.sglang_plugin import contract, patches
from ddtree_sglang.sglang_plugin.adaptive_budget import AdaptiveBudget, build_adaptive_budget
from ddtree_sglang.sglang_plugin.draft_input import make_draft_input, max_step_seq_len
from ddtree_sglang.sglang_plugin.grammar_stage import (MaskCosts, grammar_choices,
                                                      start_grammar_step)
from ddtree_sglang.sglang_plugin.host_timing import NoClock, StageClock
from ddtree_sglang.sglang_plugin.request_state import PenaltyState, request_seeds
from ddtree_sglang.sglang_plugin.server_args import settings_from_args
from ddtree_sglang.sglang_plugin.step_records import Accepted, DraftedTree, StepPlan, Verified
from ddtree_sglang.sglang_plugin.verify_attention import (SPLIT_MIN_REQUESTS, VARIANTS,
                                                          check_verify_attention)

logger = logging.getLogger(__name__)


def sample_per_node(logits: torch.Tensor, sampling_info, n: int,
                    seeds: torch.Tensor | None = None,
                    positions: torch.Tensor | None = None) -> torch.Tensor:
    """[bs * n] the target's choice at every node: argmax, or one draw from the filtered
    distribution (ddtree_sglang.sampling, joint top-k/top-p, with sgl_kernel's renorm kernels;
    rows of seeded requests draw as a function of (seed, node position))."""
    if sampling_info is None or sampling_info.is_all_greedy:
        return logits.argmax(dim=-1)

    def per_node(x):
        return torch.repeat_interleave(x, n, dim=0)

    si = sampling_info
    return sample_rows(
        logits, per_node(si.temperatures),
        per_node(si.top_ks) if si.need_top_k_sampling else None,
        per_node(si.top_ps) if si.need_top_p_sampling else None,
        per_node(si.min_ps) if si.need_min_p_sampling else None,
        top_k_renorm=contract.top_k_renorm_prob, top_p_renorm=contract.top_p_renorm_prob,
        seeds=None if seeds is None else per_node(seeds), positions=positions)


class DDTreeWorker(contract.DFlashWorkerV2):
    def __init__(self, server_args, gpu_id, ps, nccl_port, target_worker):
        contract.check_contract()
        # Both are read by init_attention_backends, which the parent's __init__ calls.
        self.settings = settings_from_args(server_args)
        started = time.perf_counter()
        self.kernels = self._choose_kernels(target_worker, gpu_id)
        checks_s = time.perf_counter() - started
        super().__init__(server_args=server_args, gpu_id=gpu_id, ps=ps, nccl_port=nccl_port,
                         target_worker=target_worker)
        s = self.settings
        self.budget, self.verify_width = s.budget, s.verify_width  # the largest tree
        self.block_size, self.depth = s.block_size, s.depth
        # The batch-aware choice's candidates, ending with B; it runs only if
        # init_cuda_graphs could build and time a verify per width.
        self.budgets = list(s.budgets)
        self._adaptive: AdaptiveBudget | None = None
        # Tokens one step can commit: at most L accepted nodes + the bonus (B >= L, see
        # server_args.check_budget), which is also the width of a result row.
        self.out_width = self.block_size
        self.speculative_num_draft_tokens = self.verify_width
        self._block_pos_offsets = contract.build_block_pos_offsets(length=self.block_size,
                                                                   device=self.device)
        self._draft_block_spec_info = contract.make_draft_block_spec_info(
            draft_token_num=self.block_size, device=self.device)
        self.vocab_size = int(self.model_runner.model_config.vocab_size)
        self.mask_costs = MaskCosts()  # per-request grammar-mask cost (grammar_stage.py)
        self._kv_move_buffers = None  # resolved at the first decode (the KV pool exists then)
        self._tree_stage = GraphedFunction(self._build_tree_stage, "DDTREE tree stage",
                                           s.cuda_graph_tree)
        self._accept_stage = GraphedFunction(self._run_accept_stage, "DDTREE accept stage",
                                             s.cuda_graph_tree)
        self._penalty_state: PenaltyState | None = None
        self._clock = StageClock() if s.host_timing and self.ps.tp_rank == 0 else NoClock()
        # What the drafter's layers compute in (its first matrix weight): the target's
        # embeddings may differ, and SGLang's eager path casts them to bfloat16.
        draft_dtype = next(p.dtype for p in self.draft_model_runner.model.parameters()
                           if p.dim() == 2 and p.is_floating_point())
        patches.keep_embeds_dtype(self.draft_model_runner.model, draft_dtype)
        # Captured here, before SGLang sizes the KV pool from the free memory, so the graphs'
        # memory is counted; init_cuda_graphs retries if the batch sizes are not known yet.
        self._tree_graphs_done = self._capture_tree_graphs("before the KV pool")
        if self.ps.tp_rank == 0:
            logger.info("DDTREE ready: budget B=%d (verify width %d), draft block %d, depth %d, "
                        "drafter weights %s; kernels: %s (startup checks %.1f s)", self.budget,
                        self.verify_width, self.block_size, self.depth, draft_dtype,
                        self.kernels.describe(), checks_s)

    def _choose_kernels(self, target_worker, gpu_id: int) -> Kernels:
        """Every kernel of the step checked once on this GPU (kernel_choice.py); the verify
        attention variant is compared here with SGLang's own extend kernel and installed by
        init_attention_backends where the target's backend is triton."""
        s = self.settings
        runner = target_worker.model_runner
        device = torch.device("cuda", gpu_id) if torch.cuda.is_available() else "cpu"
        dtype = runner.model.lm_head.weight.dtype

        def check_verify(name: str) -> str | None:
            return check_verify_attention(contract.extend_attention_fwd,
                                          contract.merge_state_triton,
                                          contract.extend_attention_signature(), device, dtype,
                                          make=VARIANTS[name])

        return choose_kernels(tree_kernel=s.tree_kernel, budget=s.budget, depth=s.depth,
                              vocab=int(runner.model_config.vocab_size), out_width=s.block_size,
                              device=device, dtype=dtype, verify_attention=s.verify_attention,
                              check_verify_attention=check_verify)

    def init_attention_backends(self):
        """After SGLang made the target's attention backend (it runs first) and before any
        graph is captured: install the tree-verify attention the kernel choice kept.  It
        replaces the triton backend's extend kernel only: the default applies there alone,
        and a variant named for another backend is dropped, with why."""
        super().init_attention_backends()
        variant = self.kernels.verify_attention
        backend = self.target_worker.model_runner.attn_backend
        if variant != "single" and not contract.is_triton_attention(backend):
            dropped = self.kernels.dropped
            if self.settings.verify_attention_named:
                dropped += ((f"{variant} verify attention", f"the target's attention backend "
                             f"is {type(backend).__name__}, not triton"),)
            self.kernels = replace(self.kernels, verify_attention="single", dropped=dropped)
            return
        if variant == "single":
            return
        patches.wrap_verify_attention(backend, VARIANTS[variant])
        if self.ps.tp_rank == 0:
            logger.info("DDTREE verify attention: %s", "split from %d requests a verify "
                        "(mask-free prefix + masked tree, merged by log-sum-exp)"
                        % SPLIT_MIN_REQUESTS if variant == "split" else "kernel (split-KV "
                        "prefix + masked tree in one online softmax, kernels/tree_attention.py)")

    def init_cuda_graphs(self):
        super().init_cuda_graphs()
        if not self._tree_graphs_done:
            self._tree_graphs_done = self._capture_tree_graphs("after the KV pool")
        if len(self.budgets) > 1:
            self._adaptive = self._build_adaptive_budget()
            if self._adaptive is None:
                self.budgets = [self.budget]

    def _build_adaptive_budget(self) -> AdaptiveBudget | None:
        variant = self.kernels.verify_attention

        def install(backend) -> None:  # the variant the configured width's backend runs
            patches.wrap_verify_attention(backend, VARIANTS[variant])

        s = self.settings
        return build_adaptive_budget(self.target_worker.model_runner, self.budgets, self.depth,
                                     self.device, None if variant == "single" else install,
                                     log=self.ps.tp_rank == 0, explore_every=s.explore_every,
                                     min_gain=s.min_gain)

    def _capture_tree_graphs(self, when: str) -> bool:
        """Capture the tree and acceptance stages for every decode CUDA-graph batch size
        (largest first, so the shared pool is sized once), then freeze them: a batch size
        seen later is padded to a captured one, nothing is captured while serving.
        Returns whether the capture question is settled."""
        if not (self._tree_stage.enabled and torch.cuda.is_available()):
            return True
        decode = contract.decode_graph_config()
        if decode is None or not decode.bs:
            return False
        if contract.graphs_disabled(decode):  # the user turned CUDA graphs off: keep it so
            self._tree_stage.enabled = self._accept_stage.enabled = False
            return True
        sizes = sorted(set(decode.bs), reverse=True)
        hidden = self.draft_model_runner.model_config.hidden_size
        dtype = self.draft_model_runner.model_config.dtype
        mem_before = torch.cuda.memory_reserved() / 2**20
        started = time.perf_counter()
        try:
            for bs in sizes:
                lay, _ = unpack_tree_stage(self._tree_stage(
                    torch.zeros((bs, self.depth, hidden), dtype=dtype, device=self.device),
                    torch.zeros(bs, dtype=torch.int64, device=self.device),
                    torch.ones(bs, dtype=torch.int64, device=self.device)))
                for budget in self.budgets:  # one acceptance graph per verify width
                    cut = truncate_layout(lay, budget + 1)
                    self._accept_stage(cut.draft_tokens.view(bs, budget + 1), cut.tree_parents,
                                       cut.tree_depths,
                                       torch.zeros((bs, budget + 1), dtype=torch.int64,
                                                   device=self.device))
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - graphs are an optimisation; eager stays exact
            logger.warning("DDTREE: startup capture of the tree stage failed (%s); it runs "
                           "eagerly", exc)
            self._tree_stage.enabled = self._accept_stage.enabled = False
            return True
        self._tree_stage.freeze()
        self._accept_stage.freeze()
        if self.ps.tp_rank == 0:
            logger.info("DDTREE tree/accept stages captured %s for batch sizes %s (%.0f MiB "
                        "graph pool, %.1f s); other sizes are padded to these", when, sizes,
                        torch.cuda.memory_reserved() / 2**20 - mem_before,
                        time.perf_counter() - started)
        return True

    def _maybe_build_draft_sampler(self):
        return None  # DDTREE needs the drafter's whole distributions, not its argmax

    def _make_next_draft_input_prefill(self, *, bonus_tokens, seq_lens):
        return make_draft_input(bonus_tokens, seq_lens)

    def _make_next_draft_input_decode(self, *, bonus_tokens, new_seq_lens):
        return make_draft_input(bonus_tokens, new_seq_lens)

    @property
    def penalty_state(self) -> PenaltyState:
        if self._penalty_state is None:
            rows = int(self.model_runner.req_to_token_pool.req_to_token.shape[0])
            self._penalty_state = PenaltyState(rows, self.vocab_size, self.device)
        return self._penalty_state

    # -- one forward -----------------------------------------------------------------------
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None):
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch or \
                batch.forward_mode.is_idle():
            return self._prefill(batch, on_publish, grammar_barrier)
        plan = self._begin_step(batch)
        hidden = self._draft(batch)
        self._clock.mark("draft")
        tree = self._build_tree(batch, plan, hidden)
        self._clock.mark("tree")
        with self._verify_runtime(plan.width):
            verified = self._verify(batch, plan, tree, grammar_barrier)
        self._clock.mark("verify")
        accepted = self._sample_and_accept(batch, plan, tree, verified)
        self._clock.mark("sample + accept")
        result = self._commit(batch, plan, tree, verified, accepted, on_publish)
        self._clock.mark("commit")
        self._end_step(plan, tree, verified, accepted)
        return result

    def _prefill(self, batch, on_publish, grammar_barrier):
        """The target's prefill pass, which also samples the first token (and computes input
        and output logprobs when asked), then the prompt's target features into the draft KV:
        DFLASH's prefill, run here because DFLASH's refuses requests with logprobs."""
        if self._adaptive is not None:
            self._adaptive.interrupt()
        if batch.forward_mode.is_idle():
            return super().forward_batch_generation(batch, on_publish, grammar_barrier)
        result = self.target_worker.forward_batch_generation(
            batch, capture_hidden_mode=contract.CaptureHiddenMode.FULL)
        logits_output, first_tokens = result.logits_output, result.next_token_ids
        result.new_seq_lens = batch.seq_lens
        if on_publish is not None:
            on_publish(batch.seq_lens)
        if logits_output.hidden_states is None:
            raise RuntimeError("DDTREE prefill needs the target's captured hidden states")
        device = first_tokens.device
        positions, _ = contract.compute_position(
            self.model_runner.server_args.attention_backend,
            torch.tensor(batch.prefix_lens, dtype=torch.int32, device=device),
            torch.tensor(batch.extend_lens, dtype=torch.int32, device=device),
            int(sum(batch.extend_lens)))
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=logits_output.hidden_states, cache_loc=batch.out_cache_loc,
            positions=positions)
        logits_output.hidden_states = None  # no host copy of the features under overlap
        result.next_draft_input = self._make_next_draft_input_prefill(
            bonus_tokens=first_tokens, seq_lens=batch.seq_lens)
        self.penalty_state.on_prefill(batch.reqs, first_tokens)
        return result

    def _begin_step(self, batch) -> StepPlan:
        """The step's batch and budget; starts the step clock and the budget controller's
        step.  The one place a decode step changes the batch it is given (seq_lens clamped,
        below); _prepare_verify builds the verify's own spec input without touching it."""
        if not isinstance(batch.spec_info, contract.DFlashDraftInputV2):
            raise RuntimeError("DDTREE expected DFlashDraftInputV2 state on the running batch")
        if batch.seq_lens.is_cuda:  # made on the scheduler's stream, used on this one
            batch.seq_lens.record_stream(torch.cuda.current_stream())
        bs = len(batch.seq_lens)
        self._clock.start(bs)
        # A request that already finished on the GPU can get one more step under overlap
        # scheduling; keep its writes inside its own row (see draft_input.py).  A running
        # request is never clamped.  (The KV reservation is always the largest width's.)
        batch.seq_lens = batch.seq_lens.clamp(
            max=max_step_seq_len(self.model_runner.req_to_token_pool.req_to_token,
                                 self.verify_width))
        adaptive = self._adaptive
        budget = self.budget if adaptive is None else adaptive.choose(bs)
        if adaptive is not None:
            adaptive.start_step(bs, budget)
        return StepPlan(bs=bs, budget=budget)

    def _end_step(self, plan: StepPlan, tree: DraftedTree, verified: Verified,
                  accepted: Accepted) -> None:
        """The budget controller learns what the step committed (and each request's budget
        is reported when traced); the step clock stops."""
        if self._adaptive is not None:
            self._adaptive.observe(plan.bs, plan.budget, tree.depth_probs,
                                   accepted.commit.commit_lens)
            if self.settings.budget_trace:
                patches.report_per_request(verified.logits_output, "ddtree_budget",
                                           [plan.budget] * plan.bs)
        self._clock.end()

    @contextmanager
    def _verify_runtime(self, width: int):
        """The target verifies through `width`'s attention backend and CUDA graphs (the
        batch-aware budget's), and everything else through the configured width's again
        afterwards, also when the verify fails."""
        runner = self.target_worker.model_runner
        configured = contract.verify_runtime(runner)
        if self._adaptive is not None:
            patches.set_verify_runtime(runner, self._adaptive.runtimes[width])
        try:
            yield
        finally:
            patches.set_verify_runtime(runner, configured)

    def _draft(self, batch) -> torch.Tensor:
        """One drafter pass over [bonus, MASK...] for every request -> [bs, block, H]."""
        return self._draft_block(batch, batch.spec_info)

    def _build_tree(self, batch, plan: StepPlan, hidden: torch.Tensor) -> DraftedTree:
        """Drafter states -> the trees cut to the plan's budget; with a grammar in the batch,
        the host copy of the tree that the bitmask needs starts here, before the verify."""
        layout, depth_probs = unpack_tree_stage(self._tree_stage(
            hidden[:, 1:, :], batch.spec_info.bonus_tokens.long(), batch.seq_lens.long()))
        layout = truncate_layout(layout, plan.width)
        grammar_tree = None
        if batch.has_grammar:
            grammar_tree = contract.GrammarTree.from_device(
                retrieve_next_token=layout.retrieve_next_token,
                retrieve_next_sibling=layout.retrieve_next_sibling,
                draft_token=layout.draft_tokens.view(plan.bs, plan.width))
        return DraftedTree(layout=layout, depth_probs=depth_probs, grammar_tree=grammar_tree)

    def _verify(self, batch, plan: StepPlan, tree: DraftedTree, grammar_barrier) -> Verified:
        """The target's pass over every tree node (through the runtime the pipeline set, see
        _verify_runtime), and the grammar's part of the step, built on the host while that
        pass runs."""
        verify_fb, can_run_graph = self._prepare_verify(batch, batch.spec_info, tree.layout)
        target_out = self.target_worker.forward_batch_generation(
            batch=None, forward_batch=verify_fb, is_verify=True)
        logits_output = target_out.logits_output
        grammar = None
        if tree.grammar_tree is not None:
            grammar = start_grammar_step(batch, tree.grammar_tree, plan.width, grammar_barrier,
                                         logits_output.next_token_logits.device,
                                         self.settings.grammar, self.mask_costs)
        return Verified(logits_output=logits_output, logits=logits_output.next_token_logits,
                        forward_batch=verify_fb, can_run_graph=can_run_graph, grammar=grammar)

    def _sample_and_accept(self, batch, plan: StepPlan, tree: DraftedTree,
                           verified: Verified) -> Accepted:
        """Each node's logits processed as plain decoding would at that node (grammar mask,
        the request's penalties with the node's own path, logit bias), one target choice per
        node, and the walk along them."""
        bs, n, lay = plan.bs, plan.width, tree.layout
        logits = verified.logits
        grammar = verified.grammar
        if grammar is not None and grammar.mask is not None:
            grammar.mask.apply(logits)
        penalties = self.penalty_state.params(batch.reqs)
        if penalties is not None:
            counts, out_len = self.penalty_state.rows_of(batch.req_pool_indices)
            penalise_nodes(logits.view(bs, n, -1)[..., : self.vocab_size], counts, out_len,
                           penalties, lay.draft_tokens.view(bs, n), lay.tree_parents,
                           lay.tree_depths, self.depth)
        contract.apply_dflash_verify_logits_adjustments(
            next_token_logits=logits, sampling_info=batch.sampling_info, draft_token_num=n)
        choice = sample_per_node(logits, batch.sampling_info, n,
                                 request_seeds(batch.reqs, self.device),
                                 lay.positions).view(bs, n)
        choice, _ = grammar_choices(grammar, logits, choice, n, self.vocab_size)
        commit = StepCommit(*self._accept_stage(lay.draft_tokens.view(bs, n), lay.tree_parents,
                                                lay.tree_depths, choice))
        return Accepted(choice=choice, commit=commit, penalties=penalties, logits=logits)

    def _commit(self, batch, plan: StepPlan, tree: DraftedTree, verified: Verified,
                accepted: Accepted, on_publish):
        """The accepted path's KV to its committed positions, its target features into the
        draft KV, the committed tokens' logprobs, the budget's statistics; the result."""
        step = accepted.commit
        if accepted.penalties is not None:
            self.penalty_state.commit(batch.req_pool_indices, step.tokens, step.commit_lens)
        new_seq_lens = batch.seq_lens + step.commit_lens.to(batch.seq_lens.dtype)
        self._move_accepted_kv(batch, step, plan.width)
        if on_publish is not None:
            on_publish(new_seq_lens)
        self._append_committed_features(batch, plan, verified, step)
        if batch.return_logprob:
            self._add_logprobs(batch, verified.logits_output, accepted.logits, step)
        result = contract.GenerationBatchResult(
            logits_output=verified.logits_output,
            next_token_ids=step.tokens.reshape(-1),
            accept_lens=step.commit_lens,
            can_run_cuda_graph=verified.can_run_graph,
            next_draft_input=self._make_next_draft_input_decode(
                bonus_tokens=step.bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=self.out_width,
            new_seq_lens=new_seq_lens,
            extra_keep_alive_refs=[verified.forward_batch, tree.layout],
        )
        return result

    def _append_committed_features(self, batch, plan: StepPlan, verified: Verified,
                                   step: StepCommit) -> None:
        """The committed tokens' target hidden states -> the draft KV at chain positions."""
        feats = verified.logits_output.hidden_states
        if feats is None:
            raise RuntimeError("DDTREE verify needs the target's captured hidden states")
        front_loc = commit_slots(batch.out_cache_loc, plan.bs, plan.width, self.out_width)
        chain_pos = batch.seq_lens.view(plan.bs, 1).to(torch.int64) + torch.arange(
            self.out_width, device=self.device)
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=feats[step.feature_rows.reshape(-1)],
            cache_loc=front_loc.reshape(-1), positions=chain_pos.reshape(-1),
            cache_loc_2d=front_loc, commit_lens=step.commit_lens)
        verified.logits_output.hidden_states = None

    def _add_logprobs(self, batch, out, logits: torch.Tensor, step: StepCommit) -> None:
        """The committed tokens' logprobs (and top / token-id logprobs when asked), read off
        the processed node `logits` as plain decoding reads them, into the logits output `out`
        in the layout SGLang's spec-v2 result processing reads: [bs, W] and bs * W rows."""
        si = batch.sampling_info
        temperatures = None if si is None or si.is_all_greedy or \
            contract.RETURN_ORIGINAL_LOGPROB else si.temperatures
        row_lp, token_lp = committed_log_probs(logits[:, : self.vocab_size],
                                               step.feature_rows, step.tokens, temperatures)
        width = self.out_width
        out.next_token_logprobs = token_lp
        if batch.top_logprobs_nums and any(k > 0 for k in batch.top_logprobs_nums):
            out.next_token_top_logprobs_val, out.next_token_top_logprobs_idx = \
                contract.get_top_logprobs(
                    row_lp, [k for k in batch.top_logprobs_nums for _ in range(width)],
                    no_copy_to_cpu=True)
        if batch.token_ids_logprobs and any(t is not None for t in batch.token_ids_logprobs):
            out.next_token_token_ids_logprobs_val, out.next_token_token_ids_logprobs_idx = \
                contract.get_token_ids_logprobs(
                    row_lp, [t for t in batch.token_ids_logprobs for _ in range(width)],
                    no_copy_to_cpu=True)

    def _build_tree_stage(self, draft_hidden, roots, seq_lens) -> tuple:
        """Drafter states -> B-best tree -> verify layout (fixed shapes; CUDA-graphed)."""
        return tree_stage(self._draft_logits(draft_hidden), roots, seq_lens, self.budget,
                          self.depth, self.kernels.build_tree,
                          tuple(self.budgets) if len(self.budgets) > 1 else ())

    def _run_accept_stage(self, tokens, parents, depths, choice) -> tuple:
        """Target choices -> StepCommit fields (fixed shapes; CUDA-graphed)."""
        return self.kernels.accept_stage(tokens, parents, depths, choice, self.depth,
                                         self.out_width)

    def _move_accepted_kv(self, batch, step: StepCommit, n: int) -> None:
        """Accepted path's K/V -> the committed positions: one launch that moves only what
        is not in place (kernels/kv_move.py), or SGLang's generic move where the kernel was
        dropped or the pool's layout is one it does not address."""
        if self._kv_move_buffers is None:
            self._kv_move_buffers = self.kernels.kv_move and contract.kv_move_buffers(
                self.model_runner.token_to_kv_pool_allocator) or False
        if self._kv_move_buffers is False:
            contract.move_accept_tokens_to_target_kvcache(
                batch, step.accept_index, step.commit_lens - 1,
                self.model_runner.token_to_kv_pool_allocator)
            return
        data_ptrs, row_bytes, max_row_bytes = self._kv_move_buffers
        tgt, src = kv_moves(batch.out_cache_loc, step.accept_index, step.commit_lens, n)
        self.kernels.move_kv_rows(data_ptrs, row_bytes, max_row_bytes, tgt, src)

    def _host_seq_lens_bound(self, batch, draft_input, extra: int):
        """Host-side per-request upper bounds on the committed lengths, and their sum.

        Under overlap scheduling the host copy lags by one step, which commits at most
        `extra` tokens; backends only need a safe bound for their host-side sizing."""
        if batch.seq_lens_cpu is not None:
            bound = batch.seq_lens_cpu + extra
            return bound, int(bound.sum())
        if draft_input.reserved_seq_lens_cpu is not None:
            return draft_input.reserved_seq_lens_cpu, int(draft_input.reserved_seq_lens_sum)
        bound = batch.seq_lens.to("cpu", dtype=torch.int32)  # only without any host copy
        return bound, int(bound.sum())

    def _draft_block(self, batch, draft_input) -> torch.Tensor:
        """One drafter pass over [bonus, MASK...] for every request -> [bs, block, H]."""
        bs, block = len(batch.seq_lens), self.block_size
        self._ensure_draft_block_buffers(bs)
        width = self._draft_block_ids_buf.shape[1]  # a shape, read on the host
        if width != block:
            raise RuntimeError(f"DDTREE: draft-block buffers are {width} wide, the draft block "
                               f"is {block}")
        block_ids = self._draft_block_ids_buf[:bs]
        positions_2d = self._draft_block_positions_buf[:bs]
        cache_loc_2d = self._draft_verify_out_cache_loc_buf[:bs]
        contract.prepare_dflash_draft_block(
            bonus_tokens=draft_input.bonus_tokens.view(-1),
            prefix_lens=batch.seq_lens.view(-1),
            req_pool_indices=batch.req_pool_indices.view(-1),
            req_to_token=self.model_runner.req_to_token_pool.req_to_token,
            block_ids_out=block_ids, positions_out=positions_2d, cache_loc_out=cache_loc_2d,
            mask_token_id=int(self._mask_token_id))
        # The drafter's forward casts these to its own dtype (contract.keep_embeds_dtype).
        embeds = self.target_worker.model_runner.model.get_input_embeddings()(block_ids)
        seq_lens_cpu, seq_lens_sum = self._host_seq_lens_bound(batch, draft_input, block)
        cpu_buf = self._draft_seq_lens_cpu_buf[:bs]
        cpu_buf.copy_(seq_lens_cpu)
        forward_batch = contract.ForwardBatch(
            forward_mode=contract.ForwardMode.TARGET_VERIFY, batch_size=bs,
            input_ids=block_ids.flatten(), req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens, out_cache_loc=cache_loc_2d.reshape(-1),
            seq_lens_sum=seq_lens_sum, seq_lens_cpu=cpu_buf,
            positions=positions_2d.reshape(-1),
            input_embeds=embeds.view(-1, embeds.shape[-1]),
            spec_algorithm=contract.SpeculativeAlgorithm.DFLASH,
            spec_info=self._draft_block_spec_info,
            capture_hidden_mode=contract.CaptureHiddenMode.NULL)
        with torch.inference_mode():
            out = self.draft_model_runner.forward(forward_batch)
        hidden = out.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE: the DFlash draft model returned no hidden states")
        return hidden.view(bs, block, -1)

    def _draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[bs, L, H] drafter states -> [bs, L, V] logits through the target's lm_head."""
        lm_head = self.target_worker.model_runner.model.lm_head
        weight = lm_head.weight
        logits = torch.matmul(hidden.to(weight.dtype), weight.T)
        return logits[..., : self.vocab_size]

    def _prepare_verify(self, batch, draft_input, layout):
        """Tree verify input + TARGET_VERIFY forward batch (graph loaded when it fits)."""
        n = layout.num_tokens_per_req  # this step's width (the bound: the widest step)
        seq_lens_cpu, seq_lens_sum = self._host_seq_lens_bound(batch, draft_input,
                                                               self.verify_width)
        mask = verify_mask(layout.ancestors, batch.seq_lens, seq_lens_sum)
        verify_input = contract.EagleVerifyInput(
            draft_token=layout.draft_tokens, custom_mask=mask, positions=layout.positions,
            retrieve_index=layout.retrieve_index,
            retrieve_next_token=layout.retrieve_next_token,
            retrieve_next_sibling=layout.retrieve_next_sibling, retrieve_cum_len=None,
            spec_steps=self.depth, topk=1, draft_token_num=n,
            capture_hidden_mode=contract.CaptureHiddenMode.FULL, seq_lens_sum=None,
            seq_lens_cpu=None)
        batch.spec_info = verify_input
        saved = batch.seq_lens_cpu, batch.seq_lens_sum
        batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu, seq_lens_sum
        try:
            verify_fb, can_run_graph = contract.eagle_prepare_for_verify(
                verify_input, self.model_runner.req_to_token_pool, batch, self.target_worker)
        finally:
            batch.seq_lens_cpu, batch.seq_lens_sum = saved
        return verify_fb, can_run_graph
