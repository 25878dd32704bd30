"""What the decode step asks of the models and of DFLASH's buffers, in one object.

`ModelIO` is the step's view (decode_step.DecodeStep takes one; tests pass their own);
`DFlashModelIO` serves it from a running DFlashWorkerV2: the draft block through DFLASH's
block buffers (whose CUDA graphs end in the tree stage, graphed_stages.TreeStage.tail_hook),
the tree verify through SGLang's EAGLE verify input, the KV move, the features appended to the
draft KV and the relay state of the next step.  `draft_logits` is the drafter's head (the
target's lm_head), which the tree stage runs.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ddtree_sglang.tree.stages import CommitSlots, StepCommit, full_mask
from ddtree_sglang.kernels.choice import Kernels
from ddtree_sglang.sglang_plugin import hybrid, patches, sglang_api as sg
from ddtree_sglang.sglang_plugin.draft_input import make_draft_input, max_step_seq_len


def draft_logits(lm_head, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[bs, L, H] drafter states -> [bs, L, V] logits through the target's lm_head."""
    weight = lm_head.weight
    return torch.matmul(hidden.to(weight.dtype), weight.T)[..., :vocab_size]


class ModelIO(Protocol):
    """What the decode step calls; DFlashModelIO's methods say what each does."""

    target_runner: Any  # the target's ModelRunner (its verify runtime is swapped per width)

    def max_step_seq_len(self) -> int: ...

    def draft_block(self, batch, draft_input) -> tuple[torch.Tensor, bool]: ...

    def target_verify(self, batch, draft_input, layout, mask_positions=None,
                      mask_buffer=None) -> tuple[Any, Any, bool, torch.Tensor]: ...

    def move_accepted_kv(self, batch, step: StepCommit, slots: CommitSlots) -> None: ...

    def append_committed_features(self, logits_output, step: StepCommit,
                                  slots: CommitSlots) -> None: ...

    def next_draft_input(self, bonus_tokens: torch.Tensor, seq_lens: torch.Tensor): ...

    def commit_recurrent_state(self, verify_backend, batch, step: StepCommit,
                               width: int) -> None: ...


class DFlashModelIO:
    """ModelIO over a DFlashWorkerV2 `worker` (its runners, block buffers and draft-KV
    writer), with the kernels the startup checks kept (`kernels.kv_move`)."""

    def __init__(self, worker, kernels: Kernels, block_size: int, verify_width: int,
                 vocab_size: int, tree_in_draft_graph: bool = False) -> None:
        self.worker, self.kernels = worker, kernels
        self.tree_in_draft_graph = tree_in_draft_graph  # the draft graphs end in the tree
        self.block_size, self.verify_width, self.vocab_size = block_size, verify_width, vocab_size
        self.target_runner = worker.target_worker.model_runner
        self.device = worker.device
        self._kv_move_buffers = None  # resolved at the first decode (the KV pool exists then)

    @property
    def req_to_token(self) -> torch.Tensor:
        """The request-to-KV-slot table (read each step: SGLang owns and may rebuild it)."""
        return self.worker.model_runner.req_to_token_pool.req_to_token

    def max_step_seq_len(self) -> int:
        return max_step_seq_len(self.req_to_token, self.verify_width)

    def next_draft_input(self, bonus_tokens: torch.Tensor, seq_lens: torch.Tensor):
        return make_draft_input(bonus_tokens, seq_lens)

    def host_seq_lens_bound(self, batch, draft_input, extra: int):
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

    def draft_block(self, batch, draft_input) -> tuple[torch.Tensor, bool]:
        """One drafter pass over [bonus, MASK...] for every request -> ([bs, block, H] its
        states, whether the pass ran the draft CUDA graph whose tail built the trees): the
        block draft of DFlashWorkerV2.forward_batch_generation (a copy, guarded by
        contract.COPIED), stopping before DFLASH's argmax: the tree needs the states."""
        w, bs, block = self.worker, len(batch.seq_lens), self.block_size
        w._ensure_draft_block_buffers(bs)
        width = w._draft_block_ids_buf.shape[1]  # a shape, read on the host
        if width != block:
            raise RuntimeError(f"DDTREE: draft-block buffers are {width} wide, the draft block "
                               f"is {block}")
        block_ids = w._draft_block_ids_buf[:bs]
        positions_2d = w._draft_block_positions_buf[:bs]
        cache_loc_2d = w._draft_verify_out_cache_loc_buf[:bs]
        sg.prepare_dflash_draft_block(
            bonus_tokens=draft_input.bonus_tokens.view(-1), prefix_lens=batch.seq_lens.view(-1),
            req_pool_indices=batch.req_pool_indices.view(-1), req_to_token=self.req_to_token,
            block_ids_out=block_ids, positions_out=positions_2d, cache_loc_out=cache_loc_2d,
            mask_token_id=int(w._mask_token_id))
        # The drafter's forward casts these to its own dtype (patches.keep_embeds_dtype).
        embeds = self.target_runner.model.get_input_embeddings()(block_ids)
        seq_lens_cpu, seq_lens_sum = self.host_seq_lens_bound(batch, draft_input, block)
        cpu_buf = w._draft_seq_lens_cpu_buf[:bs]
        cpu_buf.copy_(seq_lens_cpu)
        forward_batch = sg.ForwardBatch(
            forward_mode=sg.ForwardMode.TARGET_VERIFY, batch_size=bs,
            input_ids=block_ids.flatten(), req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens, out_cache_loc=cache_loc_2d.reshape(-1),
            seq_lens_sum=seq_lens_sum, seq_lens_cpu=cpu_buf,
            positions=positions_2d.reshape(-1), input_embeds=embeds.view(-1, embeds.shape[-1]),
            spec_algorithm=sg.SpeculativeAlgorithm.DFLASH, spec_info=w._draft_block_spec_info,
            capture_hidden_mode=sg.CaptureHiddenMode.NULL)
        with torch.inference_mode():
            out = w.draft_model_runner.forward(forward_batch)
        hidden = out.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE: the DFlash draft model returned no hidden states")
        return hidden.view(bs, block, -1), bool(out.can_run_graph and self.tree_in_draft_graph)

    def target_verify(self, batch, draft_input, layout, mask_positions=None,
                      mask_buffer=None) -> tuple[Any, Any, bool, torch.Tensor]:
        """The target's TARGET_VERIFY pass over the tree layout through SGLang's EAGLE verify
        input (its CUDA graph where one fits) -> (logits output, forward batch, graphed, the
        tree tokens' KV slots).  The mask: `mask_buffer`, the target backend's own buffer that
        the tree stage filled (SGLang's replay then copies nothing: the buffer is its own
        source), else built here, its ancestor blocks placed at `mask_positions` (the tree
        stage's; else computed here).

        SGLang's verify preparation works on the batch, as it does for DFLASH: it reads the
        verify input from batch.spec_info (set here, and left there as DFLASH leaves it) and
        the host lengths (set for the call, restored after), and writes the verify's
        input_ids, out_cache_loc (the tree's KV slots, returned) and forward mode."""
        n = layout.num_tokens_per_req  # this step's width (the bound: the widest step)
        seq_lens_cpu, seq_lens_sum = self.host_seq_lens_bound(batch, draft_input,
                                                              self.verify_width)
        mask = mask_buffer if mask_buffer is not None else full_mask(
            layout.ancestors, batch.seq_lens, seq_lens_sum, mask_positions)
        verify_input = sg.EagleVerifyInput(
            draft_token=layout.draft_tokens, custom_mask=mask, positions=layout.positions,
            retrieve_index=layout.retrieve_index,
            retrieve_next_token=layout.retrieve_next_token,
            retrieve_next_sibling=layout.retrieve_next_sibling, retrieve_cum_len=None,
            spec_steps=self.block_size - 1, topk=1, draft_token_num=n,
            capture_hidden_mode=sg.CaptureHiddenMode.FULL, seq_lens_sum=None, seq_lens_cpu=None)
        with patches.verify_on_batch(batch, verify_input, seq_lens_cpu, seq_lens_sum):
            forward_batch, can_run_graph = sg.eagle_prepare_for_verify(
                verify_input, self.worker.model_runner.req_to_token_pool, batch,
                self.worker.target_worker)
        out = self.worker.target_worker.forward_batch_generation(
            batch=None, forward_batch=forward_batch, is_verify=True)
        return out.logits_output, forward_batch, can_run_graph, batch.out_cache_loc

    def move_accepted_kv(self, batch, step: StepCommit, slots: CommitSlots) -> None:
        """Accepted path's K/V -> the committed positions: one launch that moves only what
        is not in place (kernels/kv_move.py), or SGLang's generic move where the kernel was
        dropped or the pool's layout is one it does not address."""
        allocator = self.worker.model_runner.token_to_kv_pool_allocator
        if self._kv_move_buffers is None:
            self._kv_move_buffers = self.kernels.kv_move and sg.kv_move_buffers(allocator) \
                or False
        if self._kv_move_buffers is False:
            sg.move_accept_tokens_to_target_kvcache(batch, step.accept_index,
                                                    step.commit_lens - 1, allocator)
            return
        data_ptrs, row_bytes, max_row_bytes = self._kv_move_buffers
        self.kernels.move_kv_rows(data_ptrs, row_bytes, max_row_bytes, slots.kv_target,
                                  slots.kv_source)

    def append_committed_features(self, logits_output, step: StepCommit,
                                  slots: CommitSlots) -> None:
        """The committed tokens' target hidden states -> the draft KV at their chain positions
        (slots: computed with the walk; the output's copy is dropped after: no host copy under
        overlap)."""
        feats = logits_output.hidden_states
        if feats is None:
            raise RuntimeError("DDTREE verify needs the target's captured hidden states")
        self.worker._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=feats[step.feature_rows.reshape(-1)],
            cache_loc=slots.draft_slots.reshape(-1), positions=slots.draft_positions.reshape(-1),
            cache_loc_2d=slots.draft_slots, commit_lens=step.commit_lens)
        patches.drop_hidden_states(logits_output)

    def commit_recurrent_state(self, verify_backend, batch, step: StepCommit,
                               width: int) -> None:
        """A hybrid target's recurrent state after each request's last accepted node -> its
        slot (sglang_plugin/hybrid.py), through the backend that ran this step's verify; no-op
        for a target without recurrent layers."""
        if hybrid.linear_backend(verify_backend) is None:
            return
        tracking = getattr(batch, "mamba_track_indices", None) is not None
        hybrid.commit_recurrent_state(verify_backend, self.target_runner.model, batch, step,
                                      width, sg.mamba_track_interval() if tracking else None)
