"""The SGLang contract: every private SGLang name and attribute the plugin reads, checked.

SGLang 0.5.17 has no stable API for speculative workers: the names below are private and move
between releases.  `CONTRACT` lists each callable or class with the parameters the plugin
passes; `ATTRIBUTES` lists, per class, the attributes the plugin reads on its instances
(found on the class, its dataclass fields or an assignment to `self.<name>` in its source).
`OVERRIDES` lists the parent methods the plugin's subclasses override, `COPIED` the SGLang
methods it carries a modified copy of (by a hash of their source).  `check_contract()` runs
before the worker is imported and tests/test_sglang_plugin.py runs it against the installed
SGLang, so a mismatched SGLang fails loudly at startup instead of decoding wrongly.  This file
is data and its checker; the plugin imports SGLang's names from sglang_api.py and changes
SGLang's objects in patches.py: a version bump touches these three files.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

SUPPORTED_SGLANG = "0.5.17"

# dotted path -> parameter names the plugin passes or reads (empty = existence only)
CONTRACT: dict[str, tuple[str, ...]] = {
    "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.register":
        ("name", "supports_overlap", "validate_server_args", "spec_class"),
    "sglang.srt.speculative.spec_registry.CustomSpecAlgo.__init__":
        ("name", "factory", "supports_overlap", "validate_server_args"),
    "sglang.srt.speculative.spec_registry.get_spec": ("name",),
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.__init__":
        ("server_args", "gpu_id", "ps", "nccl_port", "target_worker"),
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation":
        ("batch", "on_publish", "grammar_barrier"),
    # the forwarding of unknown attributes to the target worker (DDTreeWorker.__getattr__)
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.__getattr__": ("name",),
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc":
        ("target_hidden", "cache_loc", "positions", "cache_loc_2d", "commit_lens"),
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2._ensure_draft_block_buffers": ("bs",),
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2._maybe_build_draft_sampler": (),
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2._make_next_draft_input_decode":
        ("bonus_tokens", "new_seq_lens"),
    "sglang.kernels.ops.speculative.dflash._prepare_dflash_draft_block_unchecked":
        ("bonus_tokens", "prefix_lens", "req_pool_indices", "req_to_token", "block_ids_out",
         "positions_out", "cache_loc_out", "mask_token_id"),
    "sglang.srt.speculative.draft_worker_common.make_draft_block_spec_info":
        ("draft_token_num", "device"),
    "sglang.srt.speculative.draft_worker_common.build_block_pos_offsets": ("length", "device"),
    # the batch sizes SGLang's decode graph runners capture (clamped to the request pool)
    "sglang.srt.model_executor.runner.base_cuda_graph_runner.get_batch_sizes_to_capture":
        ("model_runner", "captured_req_width"),
    "sglang.srt.model_executor.model_runner.ModelRunner.decode_num_tokens_per_req":
        ("num_draft_tokens",),
    "sglang.srt.speculative.eagle_info.EagleVerifyInput":
        ("draft_token", "custom_mask", "positions", "retrieve_index", "retrieve_next_token",
         "retrieve_next_sibling", "retrieve_cum_len", "spec_steps", "topk", "draft_token_num",
         "capture_hidden_mode", "seq_lens_sum", "seq_lens_cpu"),
    "sglang.srt.speculative.eagle_utils.eagle_prepare_for_verify":
        ("verify_input", "req_to_token_pool", "batch", "target_worker"),
    "sglang.srt.speculative.spec_utils.move_accept_tokens_to_target_kvcache":
        ("batch", "accept_index", "num_correct_drafts", "token_to_kv_pool_allocator"),
    "sglang.srt.speculative.dflash_utils.apply_dflash_verify_logits_adjustments":
        ("next_token_logits", "sampling_info", "draft_token_num"),
    "sglang.srt.speculative.dflash_utils.validate_dflash_request": ("req", "enable_overlap"),
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info":
        ("num_tokens",),
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch":
        ("forward_mode", "batch_size", "input_ids", "req_pool_indices", "seq_lens",
         "out_cache_loc", "seq_lens_sum", "seq_lens_cpu", "positions", "input_embeds",
         "spec_algorithm", "spec_info", "capture_hidden_mode"),
    "sglang.srt.managers.overlap_utils.FutureMap.__init__":
        ("device", "spec_algo", "req_to_token_pool", "needs_cpu_seq_lens",
         "needs_confidence_relay"),
    "sglang.srt.managers.utils.GenerationBatchResult":
        ("logits_output", "next_token_ids", "accept_lens", "can_run_cuda_graph",
         "next_draft_input", "speculative_num_draft_tokens", "new_seq_lens"),
    "sglang.srt.arg_groups.speculative_hook._resolve_dflash_draft_attention_backend":
        ("server_args",),
    "sglang.srt.plugins.hook_registry.HookRegistry.register": ("target", "hook", "hook_type"),
    "sglang.srt.plugins.hook_registry.HookType.AROUND": (),
    "sglang.srt.plugins.load_plugins": (),
    "sglang.srt.runtime_context.get_spec": (),
    "sglang.srt.runtime_context.get_exec": (),
    "sglang.srt.model_executor.cuda_graph_config.Backend.DISABLED": (),
    "sglang.srt.speculative.dflash_info_v2.DFlashDraftInputV2":
        ("topk_p", "topk_index", "bonus_tokens", "new_seq_lens", "hidden_states"),
    "sglang.srt.speculative.dflash_info_v2.DFlashDraftInputV2._ensure_prepare_length_buffers":
        ("bs", "device"),
    "sglang.srt.speculative.dflash_info_v2._get_overlap_plan_stream": ("device",),
    "sglang.srt.mem_cache.allocation.alloc_for_spec_decode":
        ("tree_cache", "req_to_token_pool", "reqs", "req_pool_indices", "cur_kv_lens",
         "cur_kv_lens_cpu", "nxt_kv_lens", "nxt_kv_lens_cpu", "num_needed_tokens", "batch"),
    "sglang.srt.managers.schedule_batch.Req.update_finish_state": ("new_accepted_len",),
    # server-argument resolution: declarations are applied at the end of __post_init__
    "sglang.srt.arg_groups.overrides.run_post_process_pass": ("server_args", "fn"),
    # the KV pool's per-buffer base addresses and row bytes (see kv_move_buffers)
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._slot_move_pointer_buffers": (),
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_data_ptrs_and_strides": (),
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._move_kv_cache_impl":
        ("tgt_loc", "src_loc"),
    # casts every input_embeds to bfloat16 on the eager extend path (see keep_embeds_dtype)
    "sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs":
        ("forward_batch", "pp_proxy_tensors"),
    "sglang.srt.managers.schedule_batch.Req._check_vocab_boundary_finish":
        ("new_accepted_tokens",),
    "sglang.srt.managers.schedule_batch.Req._check_str_based_finish": ("new_accepted_len",),
    "sglang.srt.managers.schedule_batch.Req._check_token_based_finish":
        ("new_accepted_tokens",),
    "sglang.srt.model_executor.forward_batch_info.ForwardMode.TARGET_VERIFY": (),
    "sglang.srt.model_executor.forward_batch_info.CaptureHiddenMode.FULL": (),
    "sglang.srt.model_executor.forward_batch_info.CaptureHiddenMode.NULL": (),
    "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.DFLASH": (),
    # the split / kernel tree-verify attention (verify_attention.py): the Triton backend's
    # extend kernel, held as an instance attribute (every argument the wrappers read by name),
    # and the LSE merge SGLang uses for context parallelism
    "sglang.srt.layers.attention.triton_backend.TritonAttnBackend": (),
    "sglang.kernels.ops.attention.extend_attention.extend_attention_fwd":
        ("q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "qo_indptr",
         "kv_indptr", "kv_indices", "custom_mask", "mask_indptr", "max_len_extend", "k_scale",
         "v_scale", "sm_scale", "logit_cap", "lse_extend", "skip_prefix", "skip_extend",
         "skip_prefix_custom_mask", "sliding_window_size", "sinks", "window_kv_offsets",
         "xai_temperature_len", "page_size", "score_mod", "aux_tensors"),
    "sglang.kernels.ops.attention.merge_state.merge_state_triton":
        ("prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "output"),
    # the batch-aware budget (serving_budget.py): a target attention backend and verify-graph
    # runner per candidate verify width, as EAGLE's adaptive speculation builds them
    "sglang.srt.model_executor.model_runner.ModelRunner._get_attention_backend":
        ("init_new_workspace",),
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.__init__":
        ("model_runner", "attn_backend", "speculative_num_draft_tokens"),
    "sglang.srt.runtime_context.get_context": (),
    "sglang.srt.runtime_context.RuntimeContext.override": ("source",),
    "sglang.srt.model_executor.runner_backend.full_cuda_graph_backend.FullCudaGraphBackend": (),
    # per-request, per-step values SGLang copies into each response's meta_info
    "sglang.srt.layers.logits_processor.LogitsProcessorOutput": ("customized_info",),
    # prefill (worker.DDTreeWorker._prefill_or_idle): the target pass that also serves input logprobs
    "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation":
        ("batch", "forward_batch", "is_verify", "capture_hidden_mode"),
    "sglang.srt.model_executor.forward_batch_info.compute_position":
        ("attn_backend", "extend_prefix_lens", "extend_seq_lens", "extend_seq_lens_sum"),
    # structured output through the tree (decode_step.DecodeStep.build_tree, grammar_stage.py)
    "sglang.srt.speculative.spec_utils.GrammarTree.from_device":
        ("retrieve_next_token", "retrieve_next_sibling", "draft_token"),
    "sglang.srt.constrained.base_grammar_backend.GrammarMask": ("grammar", "vocab_mask"),
    "sglang.srt.speculative.eagle_utils.TreeMaskMode.FULL_MASK": (),
    # hybrid targets (sglang_plugin/hybrid.py): the recurrent half verifies along the tree and
    # commits the last accepted node's state; its conv windows stay one per node
    "sglang.srt.layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend": (),
    "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend": (),
    "sglang.srt.layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend"
    ".update_mamba_state_after_mtp_verify":
        ("last_correct_step_indices", "mamba_track_indices", "mamba_steps_to_track", "model",
         "req_pool_indices"),
    "sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool.get_speculative_mamba2_params_all_layers":
        (),
    "sglang.srt.mem_cache.memory_pool.conv_window_dedup_enabled":
        ("is_npu", "is_cpu", "speculative_eagle_topk", "is_kda"),
    # SGLANG_SIMULATE_ACC_LEN, honoured as DFLASH honours it (decode_step.py)
    "sglang.srt.speculative.spec_utils.SIMULATE_ACC_LEN": (),
    "sglang.srt.speculative.spec_utils.SIMULATE_ACC_METHOD": (),
    "sglang.srt.speculative.spec_utils.SIMULATE_ACC_TOKEN_MODE": (),
    "sglang.srt.speculative.spec_utils._sample_simulated_acc_len":
        ("simulate_acc_len", "simulate_acc_method", "max_len"),
    # SGLang's profiler spans and asynchronous NaN / Inf checks (decode_step.py)
    "sglang.srt.speculative.spec_utils.spec_stage_span": ("name",),
    "sglang.srt.utils.async_probe.maybe_detect_nan": ("tensor", "msg"),
    "sglang.srt.utils.async_probe.maybe_detect_inf": ("tensor", "msg"),
    "sglang.srt.speculative.spec_utils.traverse_tree":
        ("retrieve_next_token", "retrieve_next_sibling", "draft_tokens", "grammar",
         "allocate_token_bitmask", "vocab_size"),
    # native masks and the greedy path walk (grammar_stage.py) work on xgrammar's matcher
    "sglang.srt.constrained.xgrammar_backend.XGrammarGrammar":
        ("matcher", "vocab_size", "ctx", "override_stop_tokens"),
    # output logprobs of the committed tokens (decode_step.DecodeStep.add_logprobs)
    "sglang.srt.layers.logprob_processor.get_top_logprobs":
        ("logprobs", "top_logprobs_nums", "no_copy_to_cpu"),
    "sglang.srt.layers.logprob_processor.get_token_ids_logprobs":
        ("logprobs", "token_ids_logprobs", "no_copy_to_cpu"),
    "sglang.srt.layers.sampler.SGLANG_RETURN_ORIGINAL_LOGPROB": (),
    # tensor parallelism: each rank's vocabulary shard and the group's all-gather (sglang_api.
    # vocab_shard, sharded_topk.py)
    "sglang.srt.distributed.parallel_state.get_tp_group": (),
    "sglang.srt.distributed.parallel_state.GroupCoordinator.all_gather": ("input_", "dim"),
    "sglang.srt.layers.vocab_parallel_embedding.VocabParallelEmbeddingShardIndices": (),
}

# Methods the plugin's subclasses override, per parent: a parent method renamed in SGLang would
# leave the override silently unused, so each name must still be on the parent.
# SpeculativeAlgorithm's are the interface SGLang calls on every algorithm object, which
# CustomSpecAlgo (DDTreeSpecAlgo's base) does not define.
OVERRIDES: dict[str, tuple[str, ...]] = {
    "sglang.srt.speculative.spec_registry.CustomSpecAlgo":
        ("is_dflash_family", "supports_target_verify_for_draft", "has_draft_kv",
         "supports_grammar_overlap", "get_num_tokens_per_req_for_target_verify",
         "handle_server_args"),
    "sglang.srt.speculative.spec_info.SpeculativeAlgorithm":
        ("need_topk", "carries_draft_hidden_states", "create_future_map"),
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2":
        ("alloc_memory_pool", "init_attention_backends", "init_cuda_graphs",
         "_maybe_build_draft_sampler",
         "_make_next_draft_input_prefill", "_make_next_draft_input_decode",
         "forward_batch_generation"),
    "sglang.srt.speculative.dflash_info_v2.DFlashDraftInputV2": ("prepare_for_decode",),
}

# SGLang methods the plugin carries a modified copy of: the sha256 (first 16 hex digits) of the
# parent method's source when it was copied, and where the copy lives.  A changed parent stops
# the server naming the method, so the copy is reviewed instead of drifting silently.
COPIED: dict[str, tuple[str, str]] = {
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation":
        ("3d121465b68fda4b", "sglang_plugin/model_io.py DFlashModelIO.draft_block (its block "
         "draft) and sglang_plugin/worker.py DDTreeWorker._prefill_or_idle (its prefill)"),
    "sglang.srt.speculative.dflash_info_v2.DFlashDraftInputV2.prepare_for_decode":
        ("b88aafc416effc8f", "sglang_plugin/draft_input.py DDTreeDraftInput.prepare_for_decode"),
    "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.build_adaptive_runtime_state":
        ("d82f3392d157fbcb", "sglang_plugin/patches.py build_verify_runtime (its target half: "
         "the attention backend on a fresh workspace and the verify graph runner per width)"),
}

# SGLang behaviours the plugin relies on that no signature shows: each path's source must still
# contain the line quoted, which is the behaviour (a rewrite stops the server naming it).
SOURCE_LINES: dict[str, tuple[str, str]] = {
    # the draft graphs end in the tree stage (graphed_stages.TreeStage.tail_hook): SGLang calls
    # each capture tail hook of the runner's model runner inside every decode graph's capture
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
    ".capture_one_shape":
        ("capture_hook(self, out, forward_batch, num_tokens)",
         "capture tail hooks run inside each decode graph's capture"),
    # the tree stage writes the verify mask's ancestor blocks into the Triton backend's own
    # buffer (patches.write_mask_blocks): its graph replay copies the spec input's mask into
    # that buffer (a copy of the buffer onto itself: none), and its kernels skip the prefix
    "sglang.srt.layers.attention.triton_backend.TritonAttnBackend._update_target_verify_buffers":
        ("custom_mask[: spec_info.custom_mask.shape[0]] = spec_info.custom_mask",
         "a verify's mask reaches the graph through the backend's buffer"),
    "sglang.kernels.ops.attention.extend_attention.extend_attention_fwd":
        ("skip_prefix_custom_mask=True,", "a tree verify's mask prefix is never read"),
    # a hybrid target's recurrent layers see the tree links only where the backend's topk > 1
    # (patches.raise_linear_topk), eagerly and in its verify graphs
    "sglang.srt.layers.attention.hybrid_linear_attn_backend.MambaAttnBackendBase._forward_metadata":
        ("if self.topk > 1:", "the eager verify passes the tree links"),
    "sglang.srt.layers.attention.hybrid_linear_attn_backend.MambaAttnBackendBase._capture_metadata":
        ("if forward_mode.is_target_verify() and self.topk > 1:",
         "the captured verify binds the tree-link buffers"),
    "sglang.srt.layers.attention.hybrid_linear_attn_backend.MambaAttnBackendBase._replay_metadata":
        ("if forward_mode.is_target_verify() and self.topk > 1:",
         "the replayed verify fills the tree-link buffers"),
    "sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_update":
        ("HAS_EAGLE_TREE_CUSTOM_ATTN_MASK=retrieve_next_token is not None,",
         "the conv kernel scans each node's path from the links"),
}

# Attributes the plugin reads on instances of these classes (their own or inherited).
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    # patches.declare_server_args declares DDTREE's defaults through SGLang's override pass;
    # the fields server_args.py reads (its READ_FIELDS: a test keeps the two lists equal)
    "sglang.srt.server_args.ServerArgs": (
        "_resolved_overrides", "device", "model_path", "revision", "download_dir",
        "speculative_draft_model_path", "speculative_draft_model_revision",
        "speculative_num_draft_tokens", "speculative_dflash_block_size", "attention_backend",
        "decode_attention_backend", "prefill_attention_backend", "page_size",
        "enable_dp_attention", "tp_size", "pp_size", "speculative_draft_window_size",
        "speculative_use_rejection_sampling", "speculative_adaptive", "enable_lora",
        "speculative_num_steps", "speculative_eagle_topk", "max_running_requests",
        "enable_mixed_chunk", "enable_linear_replayssm_spec", "mamba_radix_cache_strategy"),
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2":
        ("device", "draft_model_runner", "model_runner", "ps", "target_worker",
         "_mask_token_id", "_draft_block_ids_buf", "_draft_block_positions_buf",
         "_draft_verify_out_cache_loc_buf", "_draft_seq_lens_cpu_buf",
         # written by worker.DDTreeWorker.__init__ for the parent's methods to read
         "block_size", "speculative_num_draft_tokens", "_block_pos_offsets",
         "_draft_block_spec_info"),
    "sglang.srt.speculative.dflash_info_v2.DFlashDraftInputV2":
        ("bonus_tokens", "max_top_k", "uniform_top_k_value", "reserved_seq_lens_cpu",
         "reserved_seq_lens_sum", "_prepare_batch_seq_lens_cpu_buf",
         "_prepare_cur_kv_lens_cpu_buf", "_prepare_nxt_kv_lens_cpu_buf",
         "_prepare_cur_kv_lens_gpu_buf", "_prepare_nxt_kv_lens_gpu_buf"),
    "sglang.srt.managers.schedule_batch.Req":
        ("kv", "kv_committed_len", "req_pool_idx", "output_ids", "origin_input_ids",
         "vocab_size", "return_logprob", "logprob", "sampling_params", "tokenizer", "grammar",
         "to_finish", "finished"),
    "sglang.srt.managers.schedule_batch.ReqLogprob": ("top_logprobs_num",),
    "sglang.srt.managers.schedule_batch.ReqKvInfo": ("kv_allocated_len",),
    "sglang.srt.managers.schedule_batch.ScheduleBatch":
        ("forward_mode", "is_extend_in_batch", "spec_info", "seq_lens", "seq_lens_cpu",
         "seq_lens_sum", "req_pool_indices", "out_cache_loc", "reqs", "sampling_info",
         "has_grammar", "return_logprob", "top_logprobs_nums", "token_ids_logprobs",
         "extend_lens", "prefix_lens", "req_to_token_pool", "tree_cache", "device",
         "batch_size", "mamba_track_indices"),
    "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo":
        ("is_all_greedy", "temperatures", "top_ks", "top_ps", "min_ps",
         "need_top_k_sampling", "need_top_p_sampling", "need_min_p_sampling", "vocab_size",
         "grammar_mask"),
    "sglang.srt.sampling.sampling_params.SamplingParams":
        ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
         "stop_token_ids", "sampling_seed", "max_new_tokens"),
    "sglang.srt.model_executor.model_runner.ModelRunner":
        ("req_to_token_pool", "token_to_kv_pool_allocator", "attn_backend",
         "decode_cuda_graph_runner", "model_config", "model", "init_new_workspace",
         "spec_algorithm", "is_draft_worker", "server_args", "capture_tail_hooks"),
    # the draft forward's output says whether its CUDA graph (and so the tree stage) ran
    "sglang.srt.model_executor.model_runner.ModelRunnerOutput": ("logits_output", "can_run_graph"),
    "sglang.srt.layers.logits_processor.LogitsProcessorOutput":
        ("next_token_logits", "hidden_states", "customized_info", "next_token_logprobs",
         "next_token_top_logprobs_val", "next_token_top_logprobs_idx",
         "next_token_token_ids_logprobs_val", "next_token_token_ids_logprobs_idx"),
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner":
        ("model_runner", "buffers", "captured_req_width", "backend"),
    "sglang.srt.model_executor.runner_backend.full_cuda_graph_backend.FullCudaGraphBackend":
        ("_graphs",),
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool":
        ("data_ptrs", "data_strides", "page_size"),
    "sglang.srt.layers.attention.triton_backend.TritonAttnBackend": ("verify_mask",),
    "sglang.srt.layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend":
        ("linear_attn_backend", "full_attn_backend"),
    "sglang.srt.layers.attention.hybrid_linear_attn_backend.MambaAttnBackendBase":
        ("topk", "forward_metadata"),
    "sglang.srt.mem_cache.memory_pool.HybridReqToTokenPool": ("mamba_pool",),
    "sglang.srt.mem_cache.memory_pool.MambaPool.SpeculativeState":
        ("intermediate_ssm", "intermediate_conv_window"),
    "sglang.srt.layers.attention.verify_mask.VerifyMask": ("buffer", "mode", "max_bs", "is_read"),
    "sglang.srt.distributed.parallel_state.GroupCoordinator": ("world_size",),
    "sglang.srt.layers.vocab_parallel_embedding.VocabParallelEmbeddingShardIndices":
        ("org_vocab_start_index", "num_org_elements", "num_added_elements"),
}

def resolve(path: str):
    """Import `a.b.C.meth` style dotted paths."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def contract_violations() -> list[str]:
    """Human-readable list of contract entries the installed SGLang does not satisfy."""
    problems: list[str] = []
    for table, check in ((CONTRACT, _parameter_problem), (OVERRIDES, _override_problem),
                         (COPIED, _copy_problem), (ATTRIBUTES, _attribute_problem),
                         (SOURCE_LINES, _source_problem)):
        for path, expected in table.items():
            try:
                obj = resolve(path)
            except (ImportError, AttributeError) as exc:
                problems.append(f"{path}: missing ({exc})")
                continue
            problem = check(obj, expected)
            if problem:
                problems.append(f"{path}: {problem}")
    return problems


def _parameter_problem(obj, params: tuple[str, ...]) -> str | None:
    if not params:
        return None
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "no inspectable signature"
    missing = [p for p in params if p not in sig.parameters]
    return f"parameters {missing} not in {list(sig.parameters)}" if missing else None


def _override_problem(cls, names: tuple[str, ...]) -> str | None:
    gone = [n for n in names if not callable(getattr(cls, n, None))]
    return (f"methods {gone} that DDTREE overrides are gone (its override would never be "
            "called)") if gone else None


def _copy_problem(obj, copied: tuple[str, str]) -> str | None:
    digest, copy = copied
    try:
        now = source_digest(obj)
    except (OSError, TypeError) as exc:
        return f"missing ({exc})"
    return (f"changed since DDTREE copied it (source sha256 {now}, copied from {digest}); "
            f"review the copy in {copy}") if now != digest else None


def _source_problem(obj, line: tuple[str, str]) -> str | None:
    text, why = line
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        return f"missing ({exc})"
    return None if text in source else f"no longer contains `{text}` ({why})"


def _attribute_problem(cls, names: tuple[str, ...]) -> str | None:
    known = instance_attributes(cls)
    missing = [n for n in names if n not in known and not hasattr(cls, n)]
    return f"attributes {missing} not found" if missing else None


def source_digest(obj) -> str:
    """The first 16 hex digits of the sha256 of `obj`'s source text."""
    import hashlib

    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def instance_attributes(cls: type) -> set[str]:
    """The attributes instances of `cls` get: dataclass fields, annotations, and every
    `self.<name> = ...` in the source of the class and its bases (read, never run)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        names |= set(getattr(klass, "__annotations__", {}))
        if dataclasses.is_dataclass(klass):
            names |= {f.name for f in dataclasses.fields(klass)}
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "self" and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return names


def check_contract() -> None:
    """Raise, listing every problem, where the installed SGLang breaks the contract."""
    from importlib.metadata import PackageNotFoundError, version

    problems = contract_violations()
    if problems:
        try:
            installed = version("sglang")
        except PackageNotFoundError:
            installed = "?"
        raise RuntimeError(
            f"ddtree-sglang supports SGLang {SUPPORTED_SGLANG}; the installed SGLang "
            f"{installed} lacks internals the plugin relies on (pip install "
            f"sglang=={SUPPORTED_SGLANG}):\n  "
            + "\n  ".join(problems)
        )
