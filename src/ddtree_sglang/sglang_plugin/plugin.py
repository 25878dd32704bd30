"""Entry point (group `sglang.srt.plugins`): adds `--speculative-algorithm DDTREE` to SGLang.

SGLang calls `register()` once in every process (launcher, tokenizer, each scheduler) before
server arguments are parsed.  It registers the algorithm and three method hooks:

* DecodeCudaGraphRunner.get_spec_info: the target's verify CUDA graphs must be captured with
  a custom-mask spec input, or FlashInfer/Triton would replay a causal (wrong) verify.
* validate_dflash_request: per-request rejection of what DDTREE cannot serve, with a clear
  message in the response instead of a crash (prompt token ids outside the vocabulary, which
  would kill the server); requests with logprobs, which DFLASH refuses and DDTREE serves,
  pass.
* Req.update_finish_state: EOS / stop strings among the tokens of a multi-token commit that
  crosses max_new_tokens end the request as plain decoding would (see _finish_state_hook).
* memory_pool.conv_window_dedup_enabled: a hybrid target's verify conv windows stay one per
  tree node (SGLang shares them between consecutive steps when --speculative-eagle-topk <= 1,
  right for a chain only; DDTREE sets that topk to 1).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)
_registered = False


def _worker_factory(server_args):
    """The worker class, once the installed SGLang is known to hold what it relies on (the
    contract is checked before its SGLang names are imported)."""
    from ddtree_sglang.sglang_plugin import contract

    contract.check_contract()
    from ddtree_sglang.sglang_plugin.worker import DDTreeWorker

    return DDTreeWorker


def _validate(server_args) -> None:
    """SGLang's validation hook for DDTREE (runs while SGLang resolves its arguments, in
    ServerArgs.__post_init__): pick a tree-capable attention backend when the user named none,
    then check everything; a refusal prints every problem to stderr and raises
    server_args.StartupRefusal (a launch exits 2 without a traceback)."""
    from ddtree_sglang.sglang_plugin import patches
    from ddtree_sglang.sglang_plugin.server_args import (DDTreeConfigError, StartupRefusal,
                                                         backend_to_default, validate)

    backend = backend_to_default(server_args)
    if backend is not None:
        patches.declare_server_args(server_args, {"attention_backend": backend})
        logger.info("DDTREE: no --attention-backend given; using %s (SGLang's default on this "
                    "GPU may not verify a draft tree; pass --attention-backend triton or "
                    "flashinfer to choose)", backend)
    try:
        validate(server_args)
    except DDTreeConfigError as exc:
        # The list is all a launching user reads: the refusal ends the launch without a
        # traceback (StartupRefusal says how), and still reads as a ValueError to a program.
        print(f"\n{exc}\n", file=sys.stderr, flush=True)
        raise StartupRefusal(str(exc)) from None


def is_ddtree(spec_algorithm) -> bool:
    from ddtree_sglang.sglang_plugin.server_args import ALGORITHM

    return getattr(spec_algorithm, "name", None) == ALGORITHM


def _get_spec_info_hook(original, runner, num_tokens):
    """Target runner under DDTREE: capture verify graphs with the tree-mask spec input."""
    model_runner = runner.model_runner
    if not is_ddtree(model_runner.spec_algorithm) or model_runner.is_draft_worker:
        return original(runner, num_tokens)
    from ddtree_sglang.sglang_plugin import sglang_api as sg

    block = int(model_runner.server_args.speculative_dflash_block_size)
    return sg.EagleVerifyInput(
        draft_token=None, custom_mask=runner.buffers.custom_mask, positions=None,
        retrieve_index=None, retrieve_next_token=None, retrieve_next_sibling=None,
        retrieve_cum_len=None, spec_steps=block - 1, topk=1,
        draft_token_num=runner.captured_req_width,
        capture_hidden_mode=sg.CaptureHiddenMode.FULL,
        seq_lens_sum=None, seq_lens_cpu=None,
    )


def token_id_error(ids, vocab: int | None) -> str | None:
    """Why a prompt's token ids cannot reach the model (an id outside the vocabulary makes the
    embedding lookup assert on the device and takes the whole server down), or None."""
    if ids is None or vocab is None or len(ids) == 0:
        return None
    if 0 <= min(ids) and max(ids) < vocab:
        return None
    pos, bad = next((i, int(t)) for i, t in enumerate(ids) if not 0 <= t < vocab)
    return (f"input token id {bad} at position {pos} is outside the model's vocabulary; "
            f"accepted: token ids in 0..{vocab - 1}")


def request_error(req) -> str | None:
    """Why DDTREE will not serve this request, or None.  Read from the request's fields."""
    vocab = getattr(req, "vocab_size", None)
    return (token_id_error(getattr(req, "origin_input_ids", None), vocab)
            or top_logprobs_error(req, vocab))


def top_logprobs_error(req, vocab: int | None) -> str | None:
    """Why a request's top_logprobs_num cannot be served (a top-k wider than the vocabulary
    fails inside the decode step, which would take the server down), or None."""
    k = getattr(getattr(req, "logprob", None), "top_logprobs_num", 0) or 0
    if not getattr(req, "return_logprob", False) or vocab is None or k <= vocab:
        return None
    return f"top_logprobs_num {k} exceeds the vocabulary; accepted: 0..{vocab}"


def _validate_request_hook(original, req, enable_overlap):
    """DDTREE's request check, then DFLASH's own checks with the logprob request hidden from
    them (DFLASH refuses logprobs; DDTREE computes them from its verify logits)."""
    if not _serving_ddtree():
        return original(req, enable_overlap)
    msg = request_error(req)
    if msg is not None:
        return msg
    from ddtree_sglang.sglang_plugin import patches

    with patches.logprobs_hidden(req):
        return original(req, enable_overlap)


def _finish_state_hook(original, req, new_accepted_len: int = 1):
    """A verify step can commit several tokens and cross max_new_tokens; SGLang 0.5.17 then
    ends the request with "length" before looking for EOS / stop ids / stop strings among the
    tokens inside the limit (plain decoding, one token a step, never meets this).  Look at
    those tokens first, so output and finish reason are what plain decoding gives."""
    if new_accepted_len > 1 and req.to_finish is None and not req.finished():
        # Plain decoding checks the length first, so a stop at the limit's own token still
        # ends as "length": only tokens before it can stop the request.
        cut = req.sampling_params.max_new_tokens - 1
        within = new_accepted_len - (len(req.output_ids) - cut)
        if 0 < within < new_accepted_len and _serving_ddtree():
            tail = req.output_ids[cut:]
            del req.output_ids[cut:]
            try:
                new = list(req.output_ids[-within:])
                stopped = (req._check_vocab_boundary_finish(new)
                           or req._check_str_based_finish(within)
                           or req._check_token_based_finish(new))
            finally:
                req.output_ids.extend(tail)
            if stopped:
                return None
    return original(req, new_accepted_len)


def _conv_window_dedup_hook(original, *args, **kwargs):
    """Under DDTREE a verify is a tree: dense conv windows, one per node."""
    if _serving_ddtree():
        return False
    return original(*args, **kwargs)


def _serving_ddtree() -> bool:
    from ddtree_sglang.sglang_plugin import sglang_api as sg

    return sg.runtime_spec().speculative_algorithm == "DDTREE"


def register() -> None:
    """Idempotent; stands down (with a log line) if SGLang already provides DDTREE."""
    global _registered
    if _registered:
        return
    from ddtree_sglang.sglang_plugin import sglang_api as sg
    from ddtree_sglang.sglang_plugin.server_args import ALGORITHM

    if sg.get_spec(ALGORITHM) is not None:
        logger.info("ddtree-sglang: SGLang already provides %s; the plugin stands down",
                    ALGORITHM)
        _registered = True
        return
    try:
        from ddtree_sglang.sglang_plugin.spec_algo import DDTreeSpecAlgo

        sg.SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True,
                                         validate_server_args=_validate,
                                         spec_class=DDTreeSpecAlgo)(_worker_factory)
    except ValueError as exc:  # a future SGLang that reserves the name itself
        logger.warning("ddtree-sglang: not registering %s: %s", ALGORITHM, exc)
        _registered = True
        return
    around = sg.HookType.AROUND
    sg.HookRegistry.register(
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.get_spec_info",
        _get_spec_info_hook, around)
    sg.HookRegistry.register("sglang.srt.speculative.dflash_utils.validate_dflash_request",
                             _validate_request_hook, around)
    sg.HookRegistry.register("sglang.srt.managers.schedule_batch.Req.update_finish_state",
                             _finish_state_hook, around)
    sg.HookRegistry.register("sglang.srt.mem_cache.memory_pool.conv_window_dedup_enabled",
                             _conv_window_dedup_hook, around)
    _registered = True
