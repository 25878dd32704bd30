"""DDTREE as a registered SGLang speculative algorithm (a CustomSpecAlgo subclass).

DDTREE is a DFlash-family algorithm for everything but verification: the target captures the
drafter's tapped hidden states, the target KV pool holds the draft KV, the draft runner captures
block-draft TARGET_VERIFY graphs with input embeddings, and decode reserves KV through
DFlashDraftInputV2.  So `is_dflash_family()` is True and `is_dflash()` stays False (that keeps
DDTREE out of DFLASH's own argument handling).  Two widths differ from DFLASH: the draft runner
works on the drafter's block (block_size), the target verifies the tree (B + 1 tokens).
"""

from __future__ import annotations

from ddtree_sglang.sglang_plugin import server_args as ddtree_args
from ddtree_sglang.sglang_plugin import sglang_api as sg


class DDTreeSpecAlgo(sg.CustomSpecAlgo):
    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True

    def has_draft_kv(self) -> bool:
        return True

    def supports_grammar_overlap(self) -> bool:
        # As DFLASH: the worker advances the grammars through the scheduler's barrier while the
        # verify pass runs (grammar_stage.start_grammar_step), so grammar batches keep overlap.
        return True

    # Called by the 0.5.17 scheduler on every algorithm but missing from CustomSpecAlgo.
    def need_topk(self) -> bool:
        return False

    def carries_draft_hidden_states(self) -> bool:
        return False

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False):
        return sg.future_map(device, self, req_to_token_pool, needs_cpu_seq_lens,
                             needs_confidence_relay)

    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int,
                                                 is_draft_worker: bool) -> int:
        if is_draft_worker:
            block = sg.runtime_spec().speculative_dflash_block_size
            if block is None:
                raise RuntimeError("DDTREE: speculative_dflash_block_size was not resolved")
            return int(block)
        return num_draft_tokens

    def handle_server_args(self, server_args) -> None:
        ddtree_args.apply_defaults(server_args)
        sg.resolve_draft_attention_backend(server_args)
