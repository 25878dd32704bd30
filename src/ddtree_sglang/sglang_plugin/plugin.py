"""Entry point (group `sglang.srt.plugins`): adds `--speculative-algorithm DDTREE` to SGLang.

SGLang calls `register()` once in every process (launcher, tokenizer, each scheduler) before
server arguments are parsed.  It registers the algorithm and two method hooks:

* DecodeCudaGraphRunner.get_spec_info: the target's verify CUDA graphs must be captured with
  a custom-mask spec input, or FlashInfer/Triton would replay a causal (wrong) verify.
* validate_dflash_request: per-request rejection of what DDTREE cannot serve yet, with a clear
  message in the response, instead of a scheduler crash.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
_registered = False


def _worker_factory(server_args):
    from ddtree_sglang.sglang_plugin.worker import DDTreeWorker

    return DDTreeWorker


def _validate(server_args) -> None:
    from ddtree_sglang.sglang_plugin.server_args import validate

    validate(server_args)


def is_ddtree(spec_algorithm) -> bool:
    from ddtree_sglang.sglang_plugin.server_args import ALGORITHM

    return getattr(spec_algorithm, "name", None) == ALGORITHM


def _get_spec_info_hook(original, runner, num_tokens):
    """Target runner under DDTREE: capture verify graphs with the tree-mask spec input."""
    model_runner = runner.model_runner
    if not is_ddtree(model_runner.spec_algorithm) or model_runner.is_draft_worker:
        return original(runner, num_tokens)
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    block = int(model_runner.server_args.speculative_dflash_block_size)
    return EagleVerifyInput(
        draft_token=None, custom_mask=runner.buffers.custom_mask, positions=None,
        retrieve_index=None, retrieve_next_token=None, retrieve_next_sibling=None,
        retrieve_cum_len=None, spec_steps=block - 1, topk=1,
        draft_token_num=runner.captured_req_width, capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=None, seq_lens_cpu=None,
    )


def request_error(req) -> str | None:
    """Why DDTREE will not serve this request, or None.  Read from the request's fields."""
    if getattr(req, "return_logprob", False):
        return ("DDTREE speculative decoding does not return logprobs yet; resend without "
                "logprobs / top_logprobs, or serve this request without speculative decoding")
    params = getattr(req, "sampling_params", None)
    for field in ("json_schema", "regex", "ebnf", "structural_tag"):
        if getattr(params, field, None):
            return (f"DDTREE speculative decoding does not support constrained decoding "
                    f"({field}) yet; resend without response_format / {field}")
    return None


def _validate_request_hook(original, req, enable_overlap):
    from ddtree_sglang.sglang_plugin import internals

    if internals.runtime_spec().speculative_algorithm == "DDTREE":
        msg = request_error(req)
        if msg is not None:
            return msg
    return original(req, enable_overlap)


def register() -> None:
    """Idempotent; stands down (with a log line) if SGLang already provides DDTREE."""
    global _registered
    if _registered:
        return
    from ddtree_sglang.sglang_plugin import internals
    from ddtree_sglang.sglang_plugin.server_args import ALGORITHM

    spec_algorithm, _, get_spec = internals.spec_classes()
    if get_spec(ALGORITHM) is not None:
        _registered = True
        return
    try:
        from ddtree_sglang.sglang_plugin.spec_algo import DDTreeSpecAlgo

        spec_algorithm.register(ALGORITHM, supports_overlap=True,
                                validate_server_args=_validate,
                                spec_class=DDTreeSpecAlgo)(_worker_factory)
    except ValueError as exc:  # a future SGLang that reserves the name itself
        logger.warning("ddtree-sglang: not registering %s: %s", ALGORITHM, exc)
        _registered = True
        return
    registry, hook_type = internals.hook_registry()
    registry.register(
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info",
        _get_spec_info_hook, hook_type.AROUND)
    registry.register("sglang.srt.speculative.dflash_utils.validate_dflash_request",
                      _validate_request_hook, hook_type.AROUND)
    _registered = True
