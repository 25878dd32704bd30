"""Every write the plugin makes to SGLang's objects, beside the hooks plugin.py registers: the
drafter's forward wrapper, the draft graphs' tail hook, the target's verify-attention install,
the server-argument declarations and fields, the per-width verify runtime, and the per-step
fields of the batch, the logits output, the step's result and requests.  The rest of the
plugin only reads SGLang's objects, so a release that changes a convention is reviewed here;
tests/test_patches.py scans the other modules for writes into SGLang's objects (attributes,
items, in-place tensor and container methods, `out=` arguments) and lists, with their reasons,
the few still made elsewhere (DFLASH's own buffers filled by the copies of its methods, a
request's output ids trimmed for a finish check).  Each function names the SGLang convention
its write follows.  Everything here reads only names the contract (contract.py) lists and
checks at startup, through sglang_api.py.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

from ddtree_sglang.sglang_plugin import sglang_api as sg
from ddtree_sglang.sglang_plugin.contract import SUPPORTED_SGLANG


def keep_embeds_dtype(model, dtype) -> None:
    """Make `model.forward` cast its `input_embeds` to `dtype`.

    SGLang 0.5.17's eager extend path (`ModelRunner._extend_forward_kwargs`, taken by batches
    above the largest captured graph size) turns every `input_embeds` into bfloat16, which an
    fp16 drafter's first matmul refuses.  The runners call `model.forward` directly (hooks do
    not fire), so the cast wraps that attribute on this one model instance; it is a no-op when
    the dtype already matches (the graph path, bf16 models).
    """
    inner = model.forward

    @functools.wraps(inner)  # the graph runner inspects the signature for `input_embeds`
    def forward(*args, **kwargs):
        embeds = kwargs.get("input_embeds")
        if embeds is not None and embeds.dtype != dtype:
            kwargs["input_embeds"] = embeds.to(dtype)
        return inner(*args, **kwargs)

    model.forward = forward


def wrap_verify_attention(backend, wrap) -> None:
    """Replace the target Triton backend's extend kernel by `wrap(single, merge, signature)`
    (a tree-verify attention of verify_attention.VARIANTS, which the kernel choice,
    kernels/choice.py, checked against this very kernel).  Must run before the target's CUDA
    graphs are captured: they record whichever function is called."""
    if not sg.is_triton_attention(backend):
        raise RuntimeError(f"the tree verify attention replaces the triton backend's extend "
                           f"kernel; the target's backend is {type(backend).__name__}")
    backend = sg.full_attention_backend(backend)  # a hybrid target's attention half
    single = getattr(backend, "extend_attention_fwd", None)
    if single is None:
        raise RuntimeError("the triton backend has no extend_attention_fwd attribute")
    backend.extend_attention_fwd = wrap(single, sg.merge_state_triton,
                                        sg.extend_attention_signature())


def raise_linear_topk(linear_backend, topk: int) -> None:
    """A hybrid target's recurrent-layer backend verifies along the tree: SGLang 0.5.17 hands
    its layers the tree links only where this backend's `topk` (set from
    --speculative-eagle-topk, 1 for DDTREE) is above 1, when it builds eager metadata and when
    it captures and replays verify graphs (contract.SOURCE_LINES).  Before the graphs are
    captured."""
    linear_backend.topk = topk


def add_capture_tail_hook(model_runner, hook) -> None:
    """Append `hook(graph_runner, out, forward_batch, num_tokens)` to the model runner's
    capture tail hooks: SGLang 0.5.17 calls each inside every decode CUDA graph's capture,
    after the model's forward (contract.SOURCE_LINES), which is how DFLASH folds its draft
    sampler into the draft graph.  Must run before the runner's graphs are captured."""
    model_runner.capture_tail_hooks.append(hook)


def write_mask_blocks(buffer, positions, ancestors) -> None:
    """Each request's [n, n] ancestor block into a target attention backend's flat verify-mask
    buffer (SGLang 0.5.17's VerifyMask.buffer, FULL_MASK layout: request r's block of n rows of
    seq_len + n, its tree part at each row's end), at `positions` (tree.verify_layout.
    mask_positions).  The prefix cells are left as they are: the Triton backend's kernels skip
    a tree verify's prefix part (contract.SOURCE_LINES); EAGLE writes this buffer in place after
    its draft the same way."""
    buffer.index_put_((positions.reshape(-1),), ancestors.reshape(-1).to(buffer.dtype))


def declare_server_args(server_args, fields: dict) -> None:
    """Set server arguments from inside SGLang's argument resolution.

    In 0.5.17 defaults filled during `ServerArgs.__post_init__` (the attention backend among
    them) are declarations applied at its end, so a plain assignment made by a speculative
    hook is overwritten; a declaration made here comes after SGLang's and wins.  Objects that
    are not ServerArgs (tests) get the attributes set directly; a ServerArgs without the
    override pass (another SGLang) is refused rather than set where SGLang would overwrite."""
    if not isinstance(server_args, sg.ServerArgs):
        for name, value in fields.items():
            setattr(server_args, name, value)
        return
    if not hasattr(server_args, "_resolved_overrides"):
        raise RuntimeError("this SGLang's ServerArgs has no _resolved_overrides (the override "
                           f"pass DDTREE declares its defaults through); DDTREE supports SGLang "
                           f"{SUPPORTED_SGLANG}")
    def ddtree_defaults(view) -> dict:
        return dict(fields)

    sg.run_post_process_pass(server_args, ddtree_defaults)


def build_verify_runtime(model_runner, width: int, prepare_backend=None):
    """(attention backend, verify CUDA-graph runner or None) for target verifies of `width`
    tokens a request, built as SGLang 0.5.17's EAGLE adaptive speculation builds its per-width
    states: under a temporary speculative_num_draft_tokens = width, with a fresh workspace.
    `prepare_backend(backend)` runs before the graphs are captured (they record what it
    installs)."""
    configured = sg.runtime_spec().speculative_num_draft_tokens
    sg.get_context().override("ddtree.budget_capture", speculative_num_draft_tokens=width)
    try:
        saved_workspace = model_runner.init_new_workspace
        try:
            backend = model_runner._get_attention_backend(init_new_workspace=True)
        finally:
            model_runner.init_new_workspace = saved_workspace
        if prepare_backend is not None:
            prepare_backend(backend)
        runner = None
        if model_runner.decode_cuda_graph_runner is not None:
            runner = sg.DecodeCudaGraphRunner(model_runner, attn_backend=backend,
                                           speculative_num_draft_tokens=width)
    finally:
        sg.get_context().override("ddtree.budget_restore", speculative_num_draft_tokens=configured)
    return backend, runner


def set_verify_runtime(model_runner, runtime: tuple) -> None:
    """Make the target verify through `runtime` (a pair from build_verify_runtime)."""
    model_runner.attn_backend, model_runner.decode_cuda_graph_runner = runtime


def report_per_request(logits_output, key: str, values: list) -> None:
    """One value per request of this step, which SGLang appends to each request's
    meta_info[key] (a list with one entry per decode step of that request)."""
    info = logits_output.customized_info
    if info is None:
        info = logits_output.customized_info = {}
    info[key] = values


def set_server_fields(server_args, fields: dict) -> None:
    """ServerArgs fields settled by the speculative hook's handle_server_args, where SGLang
    0.5.17 lets an algorithm set what the rest of the server reads (DFLASH sets the same
    fields for itself there)."""
    for name, value in fields.items():
        setattr(server_args, name, value)


def clamp_seq_lens(batch, max_len: int) -> None:
    """ScheduleBatch.seq_lens replaced by a clamped copy: the worker owns the running lengths
    during its step (DFLASH's worker records its stream and replaces it likewise); SGLang takes
    the step's lengths back from the result's new_seq_lens."""
    batch.seq_lens = batch.seq_lens.clamp(max=max_len)


def set_host_seq_lens(batch, seq_lens_cpu, seq_lens_sum: int) -> None:
    """ScheduleBatch.seq_lens_cpu / seq_lens_sum: the host copies of the committed lengths,
    written after the step's KV is allocated, as DFlashDraftInputV2.prepare_for_decode does."""
    batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu, seq_lens_sum


@contextmanager
def verify_on_batch(batch, verify_input, seq_lens_cpu, seq_lens_sum: int):
    """EAGLE's verify preparation (eagle_prepare_for_verify) reads its input from
    batch.spec_info and the host lengths from the batch: spec_info is set and left there, as
    DFLASH leaves its verify input; the host lengths hold the step's bound for the call and
    are restored after, also when it fails."""
    batch.spec_info = verify_input
    saved = batch.seq_lens_cpu, batch.seq_lens_sum
    batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu, seq_lens_sum
    try:
        yield
    finally:
        batch.seq_lens_cpu, batch.seq_lens_sum = saved


def drop_hidden_states(logits_output) -> None:
    """LogitsProcessorOutput.hidden_states dropped once the features are in the draft KV:
    DFLASH does the same, so that overlap scheduling copies no features to the host."""
    logits_output.hidden_states = None


def set_output_logprobs(out, token_logprobs, top=None, token_ids=None) -> None:
    """LogitsProcessorOutput's next_token_* logprob fields in the layout SGLang's spec-v2
    result processing reads ([bs, W] tokens, bs * W rows): the committed tokens' logprobs,
    and where asked the (values, indices) of the top-k and of requested token ids."""
    out.next_token_logprobs = token_logprobs
    if top is not None:
        out.next_token_top_logprobs_val, out.next_token_top_logprobs_idx = top
    if token_ids is not None:
        out.next_token_token_ids_logprobs_val, out.next_token_token_ids_logprobs_idx = token_ids


def finish_prefill(result, new_seq_lens, next_draft_input) -> None:
    """GenerationBatchResult of a prefill: its new lengths and the relay state of the first
    decode step, which DFLASH's prefill sets on the target's result the same way."""
    result.new_seq_lens = new_seq_lens
    result.next_draft_input = next_draft_input


@contextmanager
def logprobs_hidden(req):
    """Req.return_logprob reads False inside the block and is restored after: DFLASH's request
    check refuses logprob requests, which DDTREE serves (its other checks still apply)."""
    wants = req.return_logprob
    req.return_logprob = False
    try:
        yield
    finally:
        req.return_logprob = wants


def reset_grammar_mask(sampling_info) -> None:
    """SamplingBatchInfo.grammar_mask cleared at a decode step's start: the prefill leaves its
    vocabulary mask there, and SGLang's logits adjustment would apply it to every tree node
    (DDTREE applies its own per-node masks, grammar_stage.py)."""
    sampling_info.grammar_mask = None

