"""Every SGLang name the plugin uses, imported by name, and its reads of SGLang's state.

The rest of the plugin imports SGLang only through this module (`sglang_api as sg`) and
patches.py (what the plugin writes into SGLang's objects), so tools and type checkers follow
each use, and a version bump touches these two files and the contract.  Each `sglang` import
below is vouched for by an entry of contract.CONTRACT (itself or its class); a test keeps the
two equal.  The worker checks the contract (contract.check_contract) before it imports this
module, so a mismatched SGLang stops with the list of what changed, not an ImportError.
sgl_kernel is imported on first use: it loads only where CUDA is.
"""

from __future__ import annotations

import functools
import inspect

from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
from sglang.kernels.ops.attention.merge_state import merge_state_triton
from sglang.kernels.ops.speculative.dflash import (
    _prepare_dflash_draft_block_unchecked as prepare_dflash_draft_block)
from sglang.srt.arg_groups.overrides import run_post_process_pass
from sglang.srt.arg_groups.speculative_hook import _resolve_dflash_draft_attention_backend
from sglang.srt.constrained.base_grammar_backend import GrammarMask
from sglang.srt.constrained.xgrammar_backend import XGrammarGrammar
from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.layers.logprob_processor import get_token_ids_logprobs, get_top_logprobs
from sglang.srt.layers.sampler import SGLANG_RETURN_ORIGINAL_LOGPROB as RETURN_ORIGINAL_LOGPROB
from sglang.srt.managers.overlap_utils import FutureMap
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.mem_cache.allocation import alloc_for_spec_decode as _alloc_for_spec_decode
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.cuda_graph_config import Backend
from sglang.srt.model_executor.forward_batch_info import (CaptureHiddenMode, ForwardBatch,
                                                          ForwardMode, compute_position)
from sglang.srt.model_executor.runner.base_cuda_graph_runner import get_batch_sizes_to_capture
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.runtime_context import get_context, get_exec
from sglang.srt.runtime_context import get_spec as _runtime_spec
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2, _get_overlap_plan_stream
from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.draft_worker_common import (build_block_pos_offsets,
                                                        make_draft_block_spec_info)
from sglang.srt.speculative.eagle_info import EagleVerifyInput
from sglang.srt.speculative.eagle_utils import TreeMaskMode, eagle_prepare_for_verify
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec
from sglang.srt.speculative.spec_utils import (SIMULATE_ACC_LEN, SIMULATE_ACC_METHOD,
                                               SIMULATE_ACC_TOKEN_MODE, GrammarTree,
                                               _sample_simulated_acc_len,
                                               move_accept_tokens_to_target_kvcache,
                                               spec_stage_span, traverse_tree)
from sglang.srt.utils.async_probe import maybe_detect_inf, maybe_detect_nan

from ddtree_sglang.tree.acceptance import SimulatedAcceptance, curve_tau

__all__ = [  # the names the plugin uses as sg.<name>, beside the functions below
    "CaptureHiddenMode", "CustomSpecAlgo", "DFlashDraftInputV2", "DFlashWorkerV2",
    "DecodeCudaGraphRunner", "EagleVerifyInput", "ForwardBatch", "ForwardMode", "GDNAttnBackend",
    "HybridLinearAttnBackend",
    "GenerationBatchResult", "GrammarMask", "GrammarTree", "HookRegistry", "HookType",
    "RETURN_ORIGINAL_LOGPROB", "ServerArgs", "SpeculativeAlgorithm", "XGrammarGrammar",
    "apply_dflash_verify_logits_adjustments", "build_block_pos_offsets", "compute_position",
    "eagle_prepare_for_verify", "extend_attention_fwd", "get_context", "get_spec",
    "get_token_ids_logprobs", "get_top_logprobs", "load_plugins", "make_draft_block_spec_info",
    "merge_state_triton", "move_accept_tokens_to_target_kvcache", "prepare_dflash_draft_block",
    "run_post_process_pass", "traverse_tree",
]


def simulated_acceptance(curve: tuple[tuple[int, float], ...] = ()
                         ) -> SimulatedAcceptance | None:
    """A forced acceptance, or None when off: DDTREE's curve over budgets
    (SGLANG_DDTREE_SIMULATE_ACC, settings.py) where given, else SGLang's benchmark knob
    SGLANG_SIMULATE_ACC_LEN as its DFLASH reads it (one mean at every budget); the token mode
    is SGLang's SGLANG_SIMULATE_ACC_TOKEN_MODE either way."""
    if not curve and SIMULATE_ACC_LEN <= 0:
        return None
    if SIMULATE_ACC_TOKEN_MODE not in ("fixed", "real-draft-token"):
        raise ValueError(f"SGLANG_SIMULATE_ACC_TOKEN_MODE={SIMULATE_ACC_TOKEN_MODE!r} is not "
                         "accepted; accepted: fixed, real-draft-token")
    tau = functools.partial(curve_tau, curve) if curve else \
        functools.partial(_constant, float(SIMULATE_ACC_LEN))
    return SimulatedAcceptance(tau, SIMULATE_ACC_TOKEN_MODE)


def _constant(value: float, budget: int) -> float:
    del budget
    return value


def simulated_commit_len(mean: float, max_len: int) -> int:
    """This step's forced commit length in [1, max_len], drawn as SGLang draws DFLASH's
    (SGLANG_SIMULATE_ACC_METHOD)."""
    return int(_sample_simulated_acc_len(mean, SIMULATE_ACC_METHOD, max_len))


def stage_span(name: str):
    """SGLang's profiler span of a speculative stage (a shared no-op unless a profiler or NVTX
    is on), so that a trace names DDTREE's stages."""
    return spec_stage_span(name)


def detect_nan(tensor, what: str) -> None:
    """SGLang's asynchronous NaN and Inf checks (no host wait; on only under
    SGLANG_ENABLE_ASYNC_ASSERT), as EAGLE runs them on its logits."""
    maybe_detect_nan(tensor, what)
    maybe_detect_inf(tensor, what)


def top_k_renorm_prob(*args, **kwargs):
    """sgl_kernel's top-k renormalisation (public API of that package)."""
    from sgl_kernel import top_k_renorm_prob as kernel

    return kernel(*args, **kwargs)


def top_p_renorm_prob(*args, **kwargs):
    """sgl_kernel's top-p renormalisation (public API of that package)."""
    from sgl_kernel import top_p_renorm_prob as kernel

    return kernel(*args, **kwargs)


# -- reads of SGLang's private state ----------------------------------------------------------
def resolve_draft_attention_backend(server_args) -> None:
    _resolve_dflash_draft_attention_backend(server_args)


def future_map(device, spec_algo, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay):
    return FutureMap(device, spec_algo, req_to_token_pool, needs_cpu_seq_lens,
                     needs_confidence_relay)


def overlap_plan_stream(device):
    return _get_overlap_plan_stream(device)


def alloc_for_spec_decode(*args, **kwargs) -> None:
    _alloc_for_spec_decode(*args, **kwargs)


def kv_move_buffers(allocator):
    """(data_ptrs, row_bytes, max_row_bytes) of the target's KV pool for a direct slot move, or
    None where the pool's layout needs SGLang's own move (paged HND, native move, no pointers).

    `data_ptrs` / `data_strides` are what SGLang's own copy kernel reads; the largest row is
    taken from the buffers' shapes, on the host, so nothing waits for the GPU."""
    pool = allocator.get_kvcache()
    if not isinstance(pool, MHATokenToKVPool) or \
            type(pool)._move_kv_cache_impl is not MHATokenToKVPool._move_kv_cache_impl \
            or getattr(pool, "use_hnd", False) or getattr(pool, "use_native_move_kv_cache", False) \
            or getattr(pool, "data_ptrs", None) is None or getattr(pool, "page_size", 1) != 1:
        return None
    rows = pool._slot_move_pointer_buffers()
    max_bytes = max(int(x[0].numel()) * x.element_size() for x in rows)
    return pool.data_ptrs, pool.data_strides, max_bytes


def full_attention_backend(backend):
    """The backend a target's attention layers verify with: a hybrid target's full-attention
    half (its recurrent layers have their own), else the backend itself."""
    if isinstance(backend, HybridLinearAttnBackend):
        return backend.full_attn_backend
    return backend


def mamba_track_interval() -> int:
    """SGLang's prefix-state tracking interval of hybrid targets (mamba radix cache)."""
    return int(get_exec().mamba.mamba_track_interval)


def verify_mask_target(backend) -> tuple | None:
    """(flat verify-mask buffer, the most requests it holds) of a target attention backend
    whose verify reads a mask buffer it owns and skips the mask's prefix part (SGLang's Triton
    backend, VerifyMask in FULL_MASK layout; a hybrid target's full-attention half), or None."""
    backend = full_attention_backend(backend)
    if not isinstance(backend, TritonAttnBackend):
        return None
    mask = backend.verify_mask
    if mask is None or not mask.is_read or mask.mode != TreeMaskMode.FULL_MASK:
        return None
    return mask.buffer, int(mask.max_bs)


def is_triton_attention(backend) -> bool:
    """Whether a target's attention layers verify with SGLang's Triton backend (the only one
    whose extend kernel the tree-verify attention replaces)."""
    return isinstance(full_attention_backend(backend), TritonAttnBackend)


def extend_attention_signature() -> inspect.Signature:
    """The signature of SGLang's Triton extend kernel (the verify attention wrappers bind
    their calls by it)."""
    return inspect.signature(extend_attention_fwd)


def decode_graph_config():
    """SGLang's decode CUDA-graph settings (batch sizes, backend), or None if not resolved."""
    try:
        return get_exec().graph.cuda_graph_config.decode
    except Exception:  # noqa: BLE001 - not resolved yet in this process
        return None


def graphs_disabled(decode) -> bool:
    return decode.backend == Backend.DISABLED


def decode_capture_sizes(model_runner) -> list[int]:
    """The batch sizes SGLang captures this runner's decode (target-verify) graphs at: the
    configured sizes clamped to its request pool, which must exist; [] with graphs off."""
    decode = decode_graph_config()
    if decode is None or graphs_disabled(decode) or not decode.bs:
        return []
    sizes, _ = get_batch_sizes_to_capture(model_runner, model_runner.decode_num_tokens_per_req())
    return [int(b) for b in sizes]


def runtime_spec():
    return _runtime_spec()


def verify_runtime(model_runner) -> tuple:
    """The target's current (attention backend, verify-graph runner)."""
    return model_runner.attn_backend, model_runner.decode_cuda_graph_runner


def time_verify_graphs(runner, reps: int = 3) -> dict[int, float] | None:
    """Milliseconds per replay of each captured verify graph, by batch size, or None when the
    runner's graphs are not plain full CUDA graphs.  Run at startup only (it synchronises):
    the replays reuse the capture's own static inputs, so they touch only the padding slot."""
    import torch

    backend = getattr(runner, "backend", None)
    if type(backend) is not FullCudaGraphBackend:
        return None
    out: dict[int, float] = {}
    for key, graph in backend._graphs.items():
        if getattr(key, "stream_idx", None) is not None or getattr(key, "variant_label", None):
            continue
        graph.replay()  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        out[int(key.size)] = start.elapsed_time(end) / reps
    return out or None


def vocab_shard(lm_head, vocab_size: int):
    """This rank's VocabShard of a vocabulary-parallel lm_head (its global id range and the
    tensor-parallel group's all-gather, which SGLang's communicators run inside CUDA graphs),
    or None where the head holds the whole vocabulary."""
    from ddtree_sglang.tree.sharded_topk import VocabShard

    group = get_tp_group()
    if int(group.world_size) == 1 or not hasattr(lm_head, "shard_indices"):
        return None
    shard = lm_head.shard_indices
    if int(shard.num_added_elements) > 0:
        raise RuntimeError("DDTREE's tensor-parallel draft tree takes a vocabulary without "
                           "added (LoRA) tokens")
    return VocabShard(int(shard.org_vocab_start_index), int(shard.num_org_elements),
                      lambda t: group.all_gather(t.unsqueeze(0).contiguous(), dim=0))

