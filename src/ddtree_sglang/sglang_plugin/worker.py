"""DDTreeWorker: SGLang's DFlash worker with the linear verify replaced by a draft tree.

This is the class SGLang instantiates for `--speculative-algorithm DDTREE` (plugin.py checks
the SGLang contract before importing this module), and what it does at startup: the kernel
choice, the tree-verify attention install, the tree stage folded into the drafter's CUDA graphs
(a capture tail hook, checked first in a graph of its own), the accept stage's graphs, the
batch-aware budget's per-width runtimes.
Target hidden-state capture, draft-KV materialisation and the one-pass block draft are
DFlashWorkerV2's.  A decode step is decode_step.DecodeStep's, built once the KV pools exist
(init_cuda_graphs); prefill is DFLASH's, run here so that requests with logprobs are served.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import replace

import torch

from ddtree_sglang.kernels.choice import Kernels, choose_kernels
from ddtree_sglang.sglang_plugin import hybrid, patches, sglang_api as sg
from ddtree_sglang.sglang_plugin.serving_budget import ServingBudget, build_serving_budget
from ddtree_sglang.sglang_plugin.draft_input import make_draft_input
from ddtree_sglang.sglang_plugin.grammar_stage import MaskCosts
from ddtree_sglang.sglang_plugin.host_timing import NoClock, StageClock
from ddtree_sglang.sglang_plugin.model_io import DFlashModelIO, draft_logits
from ddtree_sglang.sglang_plugin.request_state import PenaltyState
from ddtree_sglang.sglang_plugin.server_args import settings_from_args
from ddtree_sglang.sglang_plugin.graphed_stages import GraphedStages
from ddtree_sglang.sglang_plugin.verify_attention import VARIANTS, check_verify_attention
from ddtree_sglang.sglang_plugin.decode_step import DecodeStep

logger = logging.getLogger(__name__)


class DDTreeWorker(sg.DFlashWorkerV2):
    def __init__(self, server_args, gpu_id, ps, nccl_port, target_worker):
        # Read by _choose_kernels below, and later by init_attention_backends (which SGLang
        # calls after the pools exist).
        self.ddtree_settings = s = settings_from_args(server_args)
        started = time.perf_counter()
        self.ddtree_kernels = self._choose_kernels(target_worker, gpu_id)
        checks_s = time.perf_counter() - started
        super().__init__(server_args=server_args, gpu_id=gpu_id, ps=ps, nccl_port=nccl_port,
                         target_worker=target_worker)
        # Read by the parent's draft-block methods (contract.ATTRIBUTES lists them): the parent
        # took its block from --speculative-num-draft-tokens, which for DDTREE is the verify
        # width B + 1; the drafter's block is the settings' block_size.
        self.block_size = s.block_size
        self.speculative_num_draft_tokens = s.verify_width
        self._block_pos_offsets = sg.build_block_pos_offsets(length=s.block_size,
                                                             device=self.device)
        self._draft_block_spec_info = sg.make_draft_block_spec_info(
            draft_token_num=s.block_size, device=self.device)
        self.ddtree_vocab_size = int(self.model_runner.model_config.vocab_size)
        lm_head = self.target_worker.model_runner.model.lm_head
        shard = sg.vocab_shard(lm_head, self.ddtree_vocab_size)
        if shard is not None:  # tp > 1: every rank merges the shards' top-K into one tree
            self.ddtree_kernels = replace(self.ddtree_kernels, vocab_shard=shard)
        # What the drafter's layers compute in (its first matrix weight): the target's
        # embeddings may differ, and SGLang's eager path casts them to bfloat16.
        draft_dtype = next(p.dtype for p in self.draft_model_runner.model.parameters()
                           if p.dim() == 2 and p.is_floating_point())
        patches.keep_embeds_dtype(self.draft_model_runner.model, draft_dtype)
        # SGLang builds this worker before the request pool exists (Scheduler.init_model_worker:
        # the worker, then alloc_memory_pool, the attention backends, the CUDA graphs): what is
        # sized by the pool is built in alloc_memory_pool, what is captured in init_cuda_graphs.
        self.ddtree_stages: GraphedStages | None = None
        self.ddtree_step: DecodeStep | None = None
        self.ddtree_tail_installed = False
        if self.ps.tp_rank == 0:
            logger.info("DDTREE ready: budget B=%d (verify width %d), draft block %d, depth %d, "
                        "drafter weights %s; kernels: %s (startup checks %.1f s)", s.budget,
                        s.verify_width, s.block_size, s.depth, draft_dtype,
                        self.ddtree_kernels.describe(), checks_s)

    def __getattr__(self, name: str):
        """DFlashWorkerV2 forwards every attribute it lacks to the target worker; DDTREE's own
        (ddtree_*) are never forwarded, so a misspelt or not yet set one raises here instead
        of reading the target's."""
        if name.startswith("ddtree_"):
            raise AttributeError(f"DDTreeWorker has no attribute {name!r} (DDTREE's own "
                                 "attributes, ddtree_*, are not forwarded to the target worker)")
        return sg.DFlashWorkerV2.__getattr__(self, name)

    def _choose_kernels(self, target_worker, gpu_id: int) -> Kernels:
        """Every kernel of the step checked once on this GPU (kernels/choice.py); the verify
        attention variant is compared here with SGLang's own extend kernel and installed by
        init_attention_backends where the target's backend is triton."""
        s = self.ddtree_settings
        runner = target_worker.model_runner
        device = torch.device("cuda", gpu_id) if torch.cuda.is_available() else "cpu"
        dtype = runner.model.lm_head.weight.dtype

        def check_verify(name: str) -> str | None:
            return check_verify_attention(sg.extend_attention_fwd, sg.merge_state_triton,
                                          sg.extend_attention_signature(), device, dtype,
                                          make=VARIANTS[name])

        return choose_kernels(tree_kernel=s.tree_kernel, budget=s.budget, depth=s.depth,
                              vocab=int(runner.model_config.vocab_size), out_width=s.block_size,
                              device=device, dtype=dtype, verify_attention=s.verify_attention,
                              check_verify_attention=check_verify)

    def init_attention_backends(self):
        """After SGLang made the target's attention backend (it runs first) and before any
        graph is captured: a hybrid target's recurrent layers set to verify along the tree,
        and the tree-verify attention the kernel choice kept installed (it replaces the triton
        backend's extend kernel only; FlashInfer verifies with its own)."""
        super().init_attention_backends()
        backend = self.target_worker.model_runner.attn_backend
        self._prepare_tree_verify(backend)
        problems = hybrid.pool_problems(self.model_runner.req_to_token_pool,
                                        self.ddtree_settings.verify_width) \
            if hybrid.linear_backend(backend) is not None else []
        if problems:
            raise RuntimeError("DDTREE cannot verify trees on this hybrid target: "
                               + "; ".join(problems))
        if self.ddtree_kernels.verify_attention != "single" and \
                not sg.is_triton_attention(backend):
            self.ddtree_kernels = replace(self.ddtree_kernels, verify_attention="single")
        elif self.ddtree_kernels.verify_attention != "single" and self.ps.tp_rank == 0:
            logger.info("DDTREE verify attention: kernel (split-KV prefix + masked tree in one "
                        "online softmax, kernels/tree_attention.py)")

    def _prepare_tree_verify(self, backend) -> None:
        """Before a target backend's verify graphs are captured: its recurrent half (a hybrid
        target's) hands its layers the tree links, and its attention half runs the
        tree-verify attention kept at startup."""
        linear = hybrid.tree_verify_backend(backend)
        if linear is not None:
            patches.raise_linear_topk(linear, hybrid.TREE_TOPK)
            if not hybrid.tree_links_on(backend):
                raise RuntimeError("DDTREE: the hybrid target's recurrent layers would not get "
                                   "the tree links")
        variant = self.ddtree_kernels.verify_attention
        if variant != "single" and sg.is_triton_attention(backend):
            patches.wrap_verify_attention(backend, VARIANTS[variant])

    def alloc_memory_pool(self, memory_pool_config=None, req_to_token_pool=None,
                          token_to_kv_pool_allocator=None):
        """The request pool exists from here on (SGLang calls this after the target's own):
        the tree and accept stages' buffers are sized by it, as EAGLE sizes its own here."""
        super().alloc_memory_pool(memory_pool_config=memory_pool_config,
                                  req_to_token_pool=req_to_token_pool,
                                  token_to_kv_pool_allocator=token_to_kv_pool_allocator)
        s = self.ddtree_settings
        lm_head = self.target_worker.model_runner.model.lm_head
        self.ddtree_stages = GraphedStages(
            self.ddtree_kernels, s.budget, s.depth, s.block_size,
            functools.partial(draft_logits, lm_head, vocab_size=self.ddtree_vocab_size),
            tuple(s.budgets), max_bs=self._max_batch_size(),
            hidden_size=self.draft_model_runner.model_config.hidden_size,
            dtype=self.draft_model_runner.model_config.dtype, device=self.device,
            simulated=sg.simulated_acceptance(s.simulate_acc))

    def _max_batch_size(self) -> int:
        """The most requests a decode batch holds (the request pool's rows), or a captured
        decode graph's batch size if larger (SGLang pads a batch up to one)."""
        runner = self.target_worker.model_runner
        pool = runner.req_to_token_pool
        if pool is None:
            raise RuntimeError("DDTREE: the step's buffers are sized by SGLang's request pool, "
                               "which does not exist yet (alloc_memory_pool runs first)")
        return max([int(pool.req_to_token.shape[0]), *sg.decode_capture_sizes(runner)])

    def init_cuda_graphs(self):
        """SGLang's target graphs exist by now: the tree and accept stages' own graphs (at the
        batch sizes SGLang captures its decode graphs at), the batch-aware budget's per-width
        runtimes, the tree stage's tail hook on the draft runner and its mask targets (each
        width's Triton backend buffer), then SGLang's draft graphs (which now end in the tree
        stage), and the decode step."""
        stages = self.ddtree_stages
        if stages is None:
            raise RuntimeError("DDTREE: init_cuda_graphs before alloc_memory_pool built the "
                               "step's buffers")
        self._capture_tree_graphs()
        s = self.ddtree_settings
        serving_budget = self._build_serving_budget() if len(s.budgets) > 1 else None
        runtimes = serving_budget.runtimes if serving_budget is not None else {
            s.verify_width: sg.verify_runtime(self.target_worker.model_runner)}
        if stages.tree.graphed.enabled and stages.tree.graphed.captured_sizes:
            # Checked capture-safe in a graph of its own above, so SGLang's captures hold it.
            stages.tree.set_mask_targets({w: target for w, (backend, _) in runtimes.items()
                                          if (target := sg.verify_mask_target(backend))})
            patches.add_capture_tail_hook(self.draft_model_runner, stages.tree.tail_hook)
            self.ddtree_tail_installed = True
        super().init_cuda_graphs()
        clock = StageClock() if s.host_timing and self.ps.tp_rank == 0 else NoClock()
        rows = int(self.model_runner.req_to_token_pool.req_to_token.shape[0])
        io = DFlashModelIO(self, self.ddtree_kernels, s.block_size, s.verify_width,
                           self.ddtree_vocab_size, tree_in_draft_graph=self.ddtree_tail_installed)
        self.ddtree_step = DecodeStep(s, self.ddtree_vocab_size, io, stages,
                                      PenaltyState(rows, self.ddtree_vocab_size, self.device),
                                      MaskCosts(), serving_budget, clock)
        if self.ps.tp_rank == 0:
            logger.info("DDTREE tree stage %s; verify masks written into the backend's buffer "
                        "at widths %s", "inside the drafter's CUDA graphs"
                        if self.ddtree_tail_installed else "outside the drafter's graphs "
                        "(its own graph per batch size, or eager)",
                        sorted(stages.tree.mask_targets) or "none")

    def _build_serving_budget(self) -> ServingBudget | None:
        s = self.ddtree_settings
        return build_serving_budget(self.target_worker.model_runner, list(s.budgets), s.depth,
                                    self.device, self._prepare_tree_verify,
                                    log=self.ps.tp_rank == 0, explore_every=s.explore_every,
                                    min_gain=s.min_gain)

    def _capture_tree_graphs(self) -> None:
        """Capture the tree stage (its graphed fallback, which also shows it capture-safe for
        the draft graphs' tail) and the accept stage at every batch size SGLang captures its
        decode graphs at (sg.decode_capture_sizes: the configured sizes clamped to the request
        pool, as SGLang's own runners clamp them; largest first, so each shared pool is sized
        once), then freeze them: a batch size seen later is padded to a captured one, nothing
        is captured while serving."""
        stages, s = self.ddtree_stages, self.ddtree_settings
        if not (stages.tree.graphed.enabled and torch.cuda.is_available()):
            return
        decode = sg.decode_graph_config()
        if decode is None or sg.graphs_disabled(decode):  # CUDA graphs off: keep it so
            stages.disable_graphs()
            return
        sizes = sorted(sg.decode_capture_sizes(self.target_worker.model_runner), reverse=True)
        hidden = self.draft_model_runner.model_config.hidden_size
        dtype = self.draft_model_runner.model_config.dtype
        mem_before = torch.cuda.memory_reserved() / 2**20
        started = time.perf_counter()

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=self.device)

        try:
            for bs in sizes:
                stages.tree.run(zeros(bs, s.depth, hidden, dtype=dtype), zeros(bs), zeros(bs) + 1)
                if s.grammar_force == "spine":  # the tree stage with a spine input
                    stages.tree.run(zeros(bs, s.depth, hidden, dtype=dtype), zeros(bs),
                                    zeros(bs) + 1, zeros(bs, s.depth) - 1)
            stages.accept.capture(sizes)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - graphs are an optimisation; eager stays exact
            logger.warning("DDTREE: startup capture of the tree and accept stages failed (%s); "
                           "they run eagerly", exc)
            stages.disable_graphs()
            return
        stages.freeze()
        if self.ps.tp_rank == 0:
            logger.info("DDTREE tree/accept stages captured for batch sizes %s (%.0f MiB graph "
                        "pool, %.1f s); other sizes are padded to these", sizes,
                        torch.cuda.memory_reserved() / 2**20 - mem_before,
                        time.perf_counter() - started)

    def _maybe_build_draft_sampler(self):
        return None  # DDTREE needs the drafter's whole distributions, not its argmax

    def _make_next_draft_input_prefill(self, *, bonus_tokens, seq_lens):
        return make_draft_input(bonus_tokens, seq_lens)

    def _make_next_draft_input_decode(self, *, bonus_tokens, new_seq_lens):
        return make_draft_input(bonus_tokens, new_seq_lens)

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None):
        step = self.ddtree_step
        if step is None:
            raise RuntimeError("DDTREE: a forward pass before init_cuda_graphs built the step")
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch or \
                batch.forward_mode.is_idle():
            return self._prefill_or_idle(step, batch, on_publish, grammar_barrier)
        return step.run(batch, on_publish, grammar_barrier)

    def _prefill_or_idle(self, step: DecodeStep, batch, on_publish, grammar_barrier):
        """The target's prefill pass, which also samples the first token (and computes input
        and output logprobs when asked), then the prompt's target features into the draft KV:
        DFLASH's prefill (a copy of that part of DFlashWorkerV2.forward_batch_generation,
        guarded by contract.COPIED), run here because DFLASH's refuses requests with logprobs.  The
        step's state learns of the new requests (penalties) and of the break (budget)."""
        if step.serving_budget is not None:
            step.serving_budget.interrupt()
        if batch.forward_mode.is_idle():
            return super().forward_batch_generation(batch, on_publish, grammar_barrier)
        result = self.target_worker.forward_batch_generation(
            batch, capture_hidden_mode=sg.CaptureHiddenMode.FULL)
        logits_output, first_tokens = result.logits_output, result.next_token_ids
        if on_publish is not None:
            on_publish(batch.seq_lens)
        if logits_output.hidden_states is None:
            raise RuntimeError("DDTREE prefill needs the target's captured hidden states")
        device = first_tokens.device
        positions, _ = sg.compute_position(
            self.model_runner.server_args.attention_backend,
            torch.tensor(batch.prefix_lens, dtype=torch.int32, device=device),
            torch.tensor(batch.extend_lens, dtype=torch.int32, device=device),
            int(sum(batch.extend_lens)))
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=logits_output.hidden_states, cache_loc=batch.out_cache_loc,
            positions=positions)
        patches.drop_hidden_states(logits_output)
        patches.finish_prefill(result, batch.seq_lens, self._make_next_draft_input_prefill(
            bonus_tokens=first_tokens, seq_lens=batch.seq_lens))
        step.penalties.on_prefill(batch.reqs, first_tokens)
        return result
