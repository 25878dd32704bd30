"""DDTREE's cross-step relay state: DFLASH's, with a KV reservation bounded by the request's row.

SGLang 0.5.17 gives every request a `req_to_token` row of context_len + 4 + N slots (N = the
verify width) and DFLASH's `prepare_for_decode` reserves committed + 2N slots per step without
a bound.  Near the context limit the reservation runs past the row: the slot indices are
written into the next request's row and later freed from it ("pool memory leak detected",
or another request's KV silently overwritten).  DDTREE reserves min(committed + 2N, row
width) instead (never less than is already allocated).  That still covers every step that
runs: a running request has committed <= context_len - 3 tokens, and a step writes N slots
past them.  A step that overlap scheduling runs for a request that already finished on the
GPU starts at most at `max_step_seq_len` (the decode step clamps the batch's lengths,
decode_step.DecodeStep.begin_step), so it writes the row's last N slots at most, which the
reservation covers.
"""

from __future__ import annotations

import torch

from ddtree_sglang.sglang_plugin import patches, sglang_api as sg


def max_step_seq_len(req_to_token: torch.Tensor, verify_width: int) -> int:
    """The largest committed length a step may start from and still write inside the row."""
    return int(req_to_token.shape[1]) - verify_width


class DDTreeDraftInput(sg.DFlashDraftInputV2):
    """DFlashDraftInputV2 whose decode reservation never passes the request's row."""

    def prepare_for_decode(self, batch) -> None:
        """DFLASH's prepare_for_decode (a copy, guarded by contract.COPIED) with each request's
        reservation bounded by its row: the KV slots of this step allocated, the batch's host
        lengths set (through patches.py), the reserved lengths kept for the step's host
        bounds (model_io.DFlashModelIO.host_seq_lens_bound)."""
        bs = batch.batch_size()
        if bs == 0:
            return
        plan_stream, plan_ctx = sg.overlap_plan_stream(batch.device)
        self._ensure_prepare_length_buffers(bs, batch.device)
        committed_cpu = self._prepare_batch_seq_lens_cpu_buf[:bs]
        cur_cpu = self._prepare_cur_kv_lens_cpu_buf[:bs]
        nxt_cpu = self._prepare_nxt_kv_lens_cpu_buf[:bs]
        width = int(sg.runtime_spec().speculative_num_draft_tokens)
        row_end = int(batch.req_to_token_pool.req_to_token.shape[1])
        needed = committed_sum = reserved_sum = 0
        for i, req in enumerate(batch.reqs):
            committed = int(req.kv_committed_len)
            allocated = int(req.kv.kv_allocated_len)
            reserved = max(allocated, min(committed + 2 * width, row_end))
            committed_cpu[i], cur_cpu[i], nxt_cpu[i] = committed, allocated, reserved
            committed_sum += committed
            reserved_sum += reserved
            needed += reserved - allocated
        self.max_top_k, self.uniform_top_k_value = 1, None  # DFLASH's sampling verify only

        caller = torch.get_device_module(batch.device).current_stream() \
            if plan_stream is not None else None
        with plan_ctx:
            if caller is not None:
                plan_stream.wait_stream(caller)  # filter/merge may have just rebuilt inputs
            cur = self._prepare_cur_kv_lens_gpu_buf[:bs]
            nxt = self._prepare_nxt_kv_lens_gpu_buf[:bs]
            cur.copy_(cur_cpu, non_blocking=True)
            nxt.copy_(nxt_cpu, non_blocking=True)
            sg.alloc_for_spec_decode(
                batch.tree_cache, batch.req_to_token_pool, reqs=batch.reqs,
                req_pool_indices=batch.req_pool_indices, cur_kv_lens=cur,
                cur_kv_lens_cpu=cur_cpu, nxt_kv_lens=nxt, nxt_kv_lens_cpu=nxt_cpu,
                num_needed_tokens=needed, batch=batch)
        if caller is not None:
            caller.wait_stream(plan_stream)
        patches.set_host_seq_lens(batch, committed_cpu, committed_sum)
        self.reserved_seq_lens_cpu = nxt_cpu
        self.reserved_seq_lens_sum = reserved_sum


_EMPTY: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _empty_fields(bs: int, device) -> tuple[torch.Tensor, ...]:
    """DFLASH's unused relay fields (topk_p, topk_index, hidden_states), [bs, 0] each: no data,
    so one set per batch size and device serves every step."""
    key = (bs, str(device))
    if key not in _EMPTY:
        _EMPTY[key] = (torch.empty((bs, 0), device=device, dtype=torch.float32),
                       torch.empty((bs, 0), device=device, dtype=torch.int64),
                       torch.empty((bs, 0), device=device, dtype=torch.float16))
    return _EMPTY[key]


def _int64(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int64 else x.to(torch.int64)


def make_draft_input(bonus_tokens: torch.Tensor, new_seq_lens: torch.Tensor) -> DDTreeDraftInput:
    """The relay state of the next step (its bonus tokens and lengths)."""
    topk_p, topk_index, hidden = _empty_fields(int(new_seq_lens.numel()), bonus_tokens.device)
    return DDTreeDraftInput(topk_p=topk_p, topk_index=topk_index,
                            bonus_tokens=_int64(bonus_tokens), new_seq_lens=_int64(new_seq_lens),
                            hidden_states=hidden)
