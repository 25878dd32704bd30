"""DDTreeWorker: SGLang's DFlash worker with the linear verify replaced by a draft tree.

Prefill, target hidden-state capture, draft-KV materialisation and the one-pass block draft are
DFlashWorkerV2's.  A decode step then:

  1. drafts the block [bonus, MASK x (bs-1)] once and takes the drafter's full distributions
     for depths 1..L through the target's lm_head (the greedy in-graph head is not used);
  2. builds the B-best tree, its verify layout and the FULL tree mask (ddtree_sglang core),
     cut to the budget chosen for this batch (adaptive_budget.py; B when pinned);
  3. verifies root + B nodes in one TARGET_VERIFY pass through SGLang's EAGLE tree-mask input
     (Triton / FlashInfer, CUDA graphs captured with the mask, see plugin.py);
  4. samples the target once per node (argmax when greedy) and walks the tree (core);
  5. moves the accepted nodes' target KV to the front of the request's slots, writes their
     target hidden states into the draft KV at chain positions, and publishes new lengths.
Before step 4 each node's logits get the request's penalties as plain decoding would apply
them at that node (its own path included; ddtree_sglang.penalties).  No step reads tensors back
to the host.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from ddtree_sglang.decode_step import (StepCommit, accept_stage, commit_slots,
                                       check_accept_kernel, check_builder,
                                       check_kv_move_kernel, check_logsumexp_kernel,
                                       check_topk_kernel,
                                       fused_accept_stage, kv_moves, move_rows,
                                       penalise_nodes, select_builder, tree_stage,
                                       truncate_layout, unpack_tree_stage, verify_mask)
from ddtree_sglang.graphed import GraphedFunction
from ddtree_sglang.sampling import sample_rows
from ddtree_sglang.sglang_plugin import internals
from ddtree_sglang.sglang_plugin.adaptive_budget import AdaptiveBudget, build_adaptive_budget
from ddtree_sglang.sglang_plugin.draft_input import make_draft_input, max_step_seq_len
from ddtree_sglang.sglang_plugin.host_timing import NoClock, StageClock
from ddtree_sglang.sglang_plugin.request_state import PenaltyState, request_seeds
from ddtree_sglang.sglang_plugin.server_args import (BUDGET_TRACE_ENV, HOST_TIMING_ENV,
                                                     VERIFY_ATTENTION_ENV,
                                                     budgets_setting, env_setting,
                                                     explore_every_setting, min_gain_setting)
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
        top_k_renorm=internals.top_k_renorm_prob, top_p_renorm=internals.top_p_renorm_prob,
        seeds=None if seeds is None else per_node(seeds), positions=positions)


class DDTreeWorker(internals.DFlashWorkerV2):
    _verify_attention = "single"  # set by init_attention_backends

    def __init__(self, server_args, gpu_id, ps, nccl_port, target_worker):
        internals.check_contract()
        super().__init__(server_args=server_args, gpu_id=gpu_id, ps=ps, nccl_port=nccl_port,
                         target_worker=target_worker)
        internals.check_inherited(self)
        self.verify_width = int(server_args.speculative_num_draft_tokens)  # N = B + 1 (max)
        self.budget = self.verify_width - 1
        # Candidate budgets of the batch-aware choice (adaptive_budget.py), ending with B; the
        # choice is made only if init_cuda_graphs could build and time a verify per width.
        self.budgets = budgets_setting(self.budget)
        self._adaptive: AdaptiveBudget | None = None
        self.block_size = int(server_args.speculative_dflash_block_size)
        self.depth = self.block_size - 1
        # Tokens one step can commit: at most L accepted nodes + the bonus (B >= L, see
        # server_args.check_budget), which is also the width of a result row.
        self.out_width = self.block_size
        self.speculative_num_draft_tokens = self.verify_width
        self._block_pos_offsets = internals.build_block_pos_offsets(length=self.block_size,
                                                                    device=self.device)
        self._draft_block_spec_info = internals.make_draft_block_spec_info(
            draft_token_num=self.block_size, device=self.device)
        self.vocab_size = int(self.model_runner.model_config.vocab_size)
        graphs = env_setting("SGLANG_DDTREE_CUDA_GRAPH_TREE") == "1"
        self._budget_trace = env_setting(BUDGET_TRACE_ENV) == "1"
        self._kv_move = None  # None: resolved at the first decode (the KV pool exists then)
        started = time.perf_counter()
        builder_name = self._choose_kernels()
        checks_s = time.perf_counter() - started
        self._tree_stage = GraphedFunction(self._build_tree_stage, "DDTREE tree stage", graphs)
        self._accept_stage = GraphedFunction(self._run_accept_stage, "DDTREE accept stage", graphs)
        self._penalty_state: PenaltyState | None = None
        self._clock = StageClock() if env_setting(HOST_TIMING_ENV) == "1" and \
            self.ps.tp_rank == 0 else NoClock()
        # What the drafter's layers compute in (its first matrix weight): the target's
        # embeddings may differ, and SGLang's eager path casts them to bfloat16.
        draft_dtype = next(p.dtype for p in self.draft_model_runner.model.parameters()
                           if p.dim() == 2 and p.is_floating_point())
        internals.keep_embeds_dtype(self.draft_model_runner.model, draft_dtype)
        # Captured here, before SGLang sizes the KV pool from the free memory, so the graphs'
        # memory is counted; init_cuda_graphs retries if the batch sizes are not known yet.
        self._tree_graphs_done = self._capture_tree_graphs("before the KV pool")
        if self.ps.tp_rank == 0:
            logger.info("DDTREE ready: budget B=%d (verify width %d), draft block %d, depth %d, "
                        "tree builder %s, drafter weights %s, target embeddings %s; startup "
                        "kernel checks %.1f s", self.budget,
                        self.verify_width, self.block_size, self.depth, builder_name,
                        draft_dtype,
                        self.target_worker.model_runner.model.get_input_embeddings().weight.dtype,
                        checks_s)

    def _choose_kernels(self) -> str:
        """The tree builder, the acceptance walk, and whether the Triton top-k, logsumexp and
        KV move are used: each kernel is compared once with its PyTorch reference on this GPU
        and dropped, with a warning, if it fails or differs.  Returns the builder's name."""
        self._builder, name = select_builder(env_setting("SGLANG_DDTREE_TREE_KERNEL"),
                                             self.budget, self.depth)
        self._accept = accept_stage
        if not torch.cuda.is_available():
            return name
        why = check_accept_kernel(self.device, self.depth, self.out_width)
        if why is None:
            self._accept = fused_accept_stage()
        else:
            logger.warning("DDTREE: the fused acceptance kernel is not used (%s); the PyTorch "
                           "accept stage walks the trees", why)
        head_dtype = self.target_worker.model_runner.model.lm_head.weight.dtype
        why = check_logsumexp_kernel(self.vocab_size, self.device, head_dtype)
        if why is not None:
            logger.warning("DDTREE: the Triton logsumexp is not used (%s); the draft "
                           "log-probabilities use torch.logsumexp in float32", why)
        why = check_topk_kernel(self.vocab_size, min(self.budget, self.vocab_size), self.device,
                                head_dtype)
        if why is not None:
            logger.warning("DDTREE: the Triton top-k is not used (%s); the draft top-k uses "
                           "torch.topk", why)
        why = check_kv_move_kernel(self.device)
        if why is not None:
            logger.warning("DDTREE: the Triton KV move is not used (%s); SGLang's generic move "
                           "commits the accepted KV", why)
            self._kv_move = False
        if name != "torch":
            why = check_builder(self._builder, self.budget, self.depth, self.vocab_size,
                                self.device, head_dtype)
            if why is not None:
                logger.warning("DDTREE: the fused tree kernel is not used (%s); the PyTorch "
                               "builder builds the same trees", why)
                self._builder, name = select_builder("torch", self.budget, self.depth)
        return name

    def init_attention_backends(self):
        """After SGLang made the target's attention backend (it runs first) and before any
        graph is captured: the split or kernel tree-verify attention, if asked for and exact
        here."""
        super().init_attention_backends()
        variant = env_setting(VERIFY_ATTENTION_ENV)
        backend = self.target_worker.model_runner.attn_backend
        if variant == "single":
            return
        if not (internals.is_triton_attention(backend) or os.environ.get(VERIFY_ATTENTION_ENV)):
            if self.ps.tp_rank == 0:  # the default: it applies to the triton backend only
                logger.info("DDTREE verify attention: %s's own", type(backend).__name__)
            return
        why = self._install_verify_attention(backend, variant)
        self._verify_attention = variant if why is None else "single"
        if self.ps.tp_rank == 0:
            if why is not None:
                logger.warning("DDTREE: verify attention stays a single masked call (%s)", why)
            elif variant == "split":
                logger.info("DDTREE verify attention: split from %d requests a verify "
                            "(mask-free prefix + masked tree, merged by log-sum-exp)",
                            SPLIT_MIN_REQUESTS)
            else:
                logger.info("DDTREE verify attention: kernel (split-KV prefix + masked tree "
                            "in one online softmax, kernels/tree_attention.py)")

    def _install_verify_attention(self, backend, variant: str) -> str | None:
        """A VARIANTS verify attention on one target attention backend; why not, or None."""
        head_dtype = self.target_worker.model_runner.model.lm_head.weight.dtype

        def check(single, merge, signature):
            return check_verify_attention(single, merge, signature, self.device, head_dtype,
                                          make=VARIANTS[variant])

        return internals.wrap_verify_attention(backend, check, VARIANTS[variant])

    def init_cuda_graphs(self):
        super().init_cuda_graphs()
        if not self._tree_graphs_done:
            self._tree_graphs_done = self._capture_tree_graphs("after the KV pool")
        if len(self.budgets) > 1:
            self._adaptive = self._build_adaptive_budget()
            if self._adaptive is None:
                self.budgets = [self.budget]

    def _build_adaptive_budget(self) -> AdaptiveBudget | None:
        variant = self._verify_attention

        def install(backend) -> None:  # the same check passed on the configured width's backend
            why = self._install_verify_attention(backend, variant)
            if why is not None:
                raise RuntimeError(f"{variant} verify attention failed on a narrower verify's "
                                   f"backend: {why}")

        return build_adaptive_budget(self.target_worker.model_runner, self.budgets, self.depth,
                                     self.device, None if variant == "single" else install,
                                     log=self.ps.tp_rank == 0,
                                     explore_every=explore_every_setting(),
                                     min_gain=min_gain_setting())

    def _capture_tree_graphs(self, when: str) -> bool:
        """Capture the tree and acceptance stages for every decode CUDA-graph batch size
        (largest first, so the shared pool is sized once), then freeze them: a batch size
        seen later is padded to a captured one, nothing is captured while serving.
        Returns whether the capture question is settled."""
        if not (self._tree_stage.enabled and torch.cuda.is_available()):
            return True
        decode = internals.decode_graph_config()
        if decode is None or not decode.bs:
            return False
        if internals.graphs_disabled(decode):  # the user turned CUDA graphs off: keep it so
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

    # -- decode ----------------------------------------------------------------------------
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None):
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch or \
                batch.forward_mode.is_idle():
            if self._adaptive is not None:
                self._adaptive.interrupt()
            result = super().forward_batch_generation(batch, on_publish, grammar_barrier)
            if not batch.forward_mode.is_idle() and result.next_token_ids is not None:
                self.penalty_state.on_prefill(batch.reqs, result.next_token_ids)
            return result
        if batch.spec_info is None or not isinstance(batch.spec_info,
                                                           internals.DFlashDraftInputV2):
            raise RuntimeError("DDTREE expected DFlashDraftInputV2 state on the running batch")
        draft_input = batch.spec_info
        batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())
        bs = len(batch.seq_lens)
        clock = self._clock
        clock.start(bs)
        # A request that already finished on the GPU can get one more step under overlap
        # scheduling; keep its writes inside its own row (see draft_input.py).  A running
        # request is never clamped.  (The KV reservation is always the largest width's.)
        batch.seq_lens = batch.seq_lens.clamp(
            max=max_step_seq_len(self.model_runner.req_to_token_pool.req_to_token,
                                 self.verify_width))
        adaptive = self._adaptive
        budget = self.budget if adaptive is None else adaptive.choose(bs)
        n = budget + 1  # this step's verify width
        if adaptive is not None:
            adaptive.start_step(bs, budget)

        hidden = self._draft_block(batch, draft_input)  # [bs, block, H]
        clock.mark("draft")
        layout, depth_probs = unpack_tree_stage(self._tree_stage(
            hidden[:, 1:, :], draft_input.bonus_tokens.long(), batch.seq_lens.long()))
        layout = truncate_layout(layout, n)
        clock.mark("tree")

        target_runner = self.target_worker.model_runner
        configured = internals.verify_runtime(target_runner)
        if adaptive is not None:
            internals.set_verify_runtime(target_runner, adaptive.runtimes[n])
        try:
            verify_fb, can_run_graph = self._prepare_verify(batch, draft_input, layout)
            target_out = self.target_worker.forward_batch_generation(
                batch=None, forward_batch=verify_fb, is_verify=True)
        finally:  # prefill and everything else see the configured width's runtime
            internals.set_verify_runtime(target_runner, configured)
        clock.mark("verify")
        logits_output = target_out.logits_output
        logits = logits_output.next_token_logits
        penalties = self.penalty_state.params(batch.reqs)
        if penalties is not None:
            counts, out_len = self.penalty_state.rows_of(batch.req_pool_indices)
            penalise_nodes(logits.view(bs, n, -1)[..., : self.vocab_size], counts, out_len,
                           penalties, layout.draft_tokens.view(bs, n), layout.tree_parents,
                           layout.tree_depths, self.depth)
        internals.apply_dflash_verify_logits_adjustments(next_token_logits=logits,
                                               sampling_info=batch.sampling_info,
                                               draft_token_num=n)
        choice = sample_per_node(logits, batch.sampling_info, n,
                                 request_seeds(batch.reqs, self.device),
                                 layout.positions).view(bs, n)
        step = StepCommit(*self._accept_stage(layout.draft_tokens.view(bs, n),
                                              layout.tree_parents, layout.tree_depths, choice))
        commit_lens = step.commit_lens
        clock.mark("sample + accept")
        if penalties is not None:
            self.penalty_state.commit(batch.req_pool_indices, step.tokens, commit_lens)
        new_seq_lens = batch.seq_lens + commit_lens.to(batch.seq_lens.dtype)
        self._move_accepted_kv(batch, step, n)
        if on_publish is not None:
            on_publish(new_seq_lens)

        feats = logits_output.hidden_states
        if feats is None:
            raise RuntimeError("DDTREE verify needs the target's captured hidden states")
        front_loc = commit_slots(batch.out_cache_loc, bs, n, self.out_width)
        chain_pos = batch.seq_lens.view(bs, 1).to(torch.int64) + torch.arange(
            self.out_width, device=self.device)
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=feats[step.feature_rows.reshape(-1)],
            cache_loc=front_loc.reshape(-1), positions=chain_pos.reshape(-1),
            cache_loc_2d=front_loc, commit_lens=commit_lens)
        logits_output.hidden_states = None
        clock.mark("commit")
        if adaptive is not None:
            adaptive.observe(bs, budget, depth_probs, commit_lens)
            if self._budget_trace:
                internals.report_per_request(logits_output, "ddtree_budget", [budget] * bs)

        result = internals.GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=step.tokens.reshape(-1),
            accept_lens=commit_lens,
            can_run_cuda_graph=can_run_graph,
            next_draft_input=self._make_next_draft_input_decode(
                bonus_tokens=step.bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=self.out_width,
            new_seq_lens=new_seq_lens,
            extra_keep_alive_refs=[verify_fb, layout],
        )
        clock.end()
        return result

    def _build_tree_stage(self, draft_hidden, roots, seq_lens) -> tuple:
        """Drafter states -> B-best tree -> verify layout (fixed shapes; CUDA-graphed)."""
        return tree_stage(self._draft_logits(draft_hidden), roots, seq_lens, self.budget,
                          self.depth, self._builder,
                          tuple(self.budgets) if len(self.budgets) > 1 else ())

    def _run_accept_stage(self, tokens, parents, depths, choice) -> tuple:
        """Target choices -> StepCommit fields (fixed shapes; CUDA-graphed)."""
        return self._accept(tokens, parents, depths, choice, self.depth, self.out_width)

    def _move_accepted_kv(self, batch, step: StepCommit, n: int) -> None:
        """Accepted path's K/V -> the committed positions: one launch that moves only what
        is not in place (kernels/kv_move.py), or SGLang's generic move for pool layouts the
        kernel does not address."""
        if self._kv_move is None:
            self._kv_move = internals.kv_move_buffers(
                self.model_runner.token_to_kv_pool_allocator) or False
        if self._kv_move is False:
            internals.move_accept_tokens_to_target_kvcache(
                batch, step.accept_index, step.commit_lens - 1,
                self.model_runner.token_to_kv_pool_allocator)
            return
        data_ptrs, row_bytes, max_row_bytes = self._kv_move
        tgt, src = kv_moves(batch.out_cache_loc, step.accept_index, step.commit_lens, n)
        move_rows(data_ptrs, row_bytes, max_row_bytes, tgt, src)

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
        internals.prepare_dflash_draft_block(
            bonus_tokens=draft_input.bonus_tokens.view(-1),
            prefix_lens=batch.seq_lens.view(-1),
            req_pool_indices=batch.req_pool_indices.view(-1),
            req_to_token=self.model_runner.req_to_token_pool.req_to_token,
            block_ids_out=block_ids, positions_out=positions_2d, cache_loc_out=cache_loc_2d,
            mask_token_id=int(self._mask_token_id))
        # The drafter's forward casts these to its own dtype (internals.keep_embeds_dtype).
        embeds = self.target_worker.model_runner.model.get_input_embeddings()(block_ids)
        seq_lens_cpu, seq_lens_sum = self._host_seq_lens_bound(batch, draft_input, block)
        cpu_buf = self._draft_seq_lens_cpu_buf[:bs]
        cpu_buf.copy_(seq_lens_cpu)
        forward_batch = internals.ForwardBatch(
            forward_mode=internals.ForwardMode.TARGET_VERIFY, batch_size=bs,
            input_ids=block_ids.flatten(), req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens, out_cache_loc=cache_loc_2d.reshape(-1),
            seq_lens_sum=seq_lens_sum, seq_lens_cpu=cpu_buf,
            positions=positions_2d.reshape(-1),
            input_embeds=embeds.view(-1, embeds.shape[-1]),
            spec_algorithm=internals.SpeculativeAlgorithm.DFLASH,
            spec_info=self._draft_block_spec_info,
            capture_hidden_mode=internals.CaptureHiddenMode.NULL)
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
        verify_input = internals.EagleVerifyInput(
            draft_token=layout.draft_tokens, custom_mask=mask, positions=layout.positions,
            retrieve_index=layout.retrieve_index,
            retrieve_next_token=layout.retrieve_next_token,
            retrieve_next_sibling=layout.retrieve_next_sibling, retrieve_cum_len=None,
            spec_steps=self.depth, topk=1, draft_token_num=n,
            capture_hidden_mode=internals.CaptureHiddenMode.FULL, seq_lens_sum=None,
            seq_lens_cpu=None)
        batch.spec_info = verify_input
        saved = batch.seq_lens_cpu, batch.seq_lens_sum
        batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu, seq_lens_sum
        try:
            verify_fb, can_run_graph = internals.eagle_prepare_for_verify(
                verify_input, self.model_runner.req_to_token_pool, batch, self.target_worker)
        finally:
            batch.seq_lens_cpu, batch.seq_lens_sum = saved
        return verify_fb, can_run_graph
