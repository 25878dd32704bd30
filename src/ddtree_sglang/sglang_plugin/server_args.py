"""DDTREE's server arguments: validation with clear errors, and the defaults it applies.

The tree budget rides on SGLang's existing flag: --speculative-num-draft-tokens = B + 1 (the
verify width: the root plus B tree nodes).  The draft block size comes from the drafter's
config (or --speculative-dflash-block-size, which may only shrink it); the tree depth is
block_size - 1.  Every ServerArgs field read here is named in READ_FIELDS (and in the
contract's ServerArgs entry) and read without a default: a field SGLang renamed stops startup
with its name instead of silently switching its refusal off.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ddtree_sglang.dflash.config import (DFlashConfig, NotADFlashCheckpoint, load_dflash_config,
                                         untappable_layers)
from ddtree_sglang.dflash.files import ModelNotFound, model_dir
from ddtree_sglang.sglang_plugin.settings import (CHECKED_PAGE_SIZES, DEBUG_ENV, MAX_BUDGET,
                                                  MAX_UNCHECKED_PAGE_SIZE, DDTreeConfigError,
                                                  DDTreeSettings, debug_flags)

logger = logging.getLogger(__name__)

ALGORITHM = "DDTREE"
DEFAULT_BUDGET = 32
TREE_BACKENDS = ("triton", "flashinfer")
# Used when the user names no attention backend: SGLang's own default (fa3 on Hopper) cannot
# verify a tree; triton is the backend every DDTREE benchmark and check ran with.
DEFAULT_TREE_BACKEND = "triton"
WHY_NOT = {
    "fa3": "FlashAttention-3 applies the tree mask only when the global EAGLE topk > 1, "
           "and is Hopper-only (not on sm_120)",
    "fa4": "FlashAttention-4 takes no custom tree mask (and is sm_100-only)",
    "trtllm_mha": "TensorRT-LLM MHA takes no custom tree mask (and does not run on sm_120)",
    "trtllm_mla": "TensorRT-LLM MLA takes no custom tree mask",
    "flashmla": "FlashMLA takes no custom tree mask",
}
HYBRID_LAYER_TYPES = {"linear_attention", "mamba", "mamba2", "gated_deltanet", "ssm",
                      "conv", "recurrent"}
# Hybrids with gated-delta (GDN) recurrent layers, whose tree verify SGLang runs for EAGLE and
# DDTREE wires (sglang_plugin/hybrid.py): implemented, started under SGLANG_DDTREE_DEBUG=unchecked
# until a GPU run checks them against plain SGLang.
GDN_HYBRID_MODEL_TYPES = {"qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text",
                          "qwen3_5_moe_text"}
HYBRID_MODEL_TYPES = {"qwen3_next", "qwen3_5", "qwen3_5_moe", "falcon_h1", "nemotron_h",
                      "jamba", "mamba", "mamba2", "bamba", "granitemoehybrid", "kimi_linear",
                      "lfm2", "minimax_m1", "plamo2", "zamba2"}


# What --speculative-draft-model-path accepts (each refusal of it names this).
DRAFTER_ACCEPTED = ("a DFlash drafter for this target, by hub ID (e.g. "
                    "z-lab/Qwen3-8B-DFlash-b16) or local directory")
# The exit status of a launch DDTREE refuses (argparse's, for arguments it refuses itself).
REFUSED_EXIT_STATUS = 2


class StartupRefusal(SystemExit, DDTreeConfigError):
    """DDTREE's refusal of a server's arguments, raised from SGLang's validation hook.

    Both kinds at once, because the hook cannot tell who resolves the arguments: a program that
    builds ServerArgs itself (sglang.Engine, tests) catches a DDTreeConfigError (a ValueError)
    naming every problem, while a launch (`sglang serve`, `python -m sglang.launch_server`),
    where SGLang lets it through uncaught, ends with exit status 2 and no traceback (the
    interpreter treats an uncaught SystemExit as a plain exit): the user reads only the list,
    which the hook prints first."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = REFUSED_EXIT_STATUS


# Every ServerArgs field DDTREE reads (contract.ATTRIBUTES holds the same names).
READ_FIELDS = (
    "device", "model_path", "revision", "download_dir", "speculative_draft_model_path",
    "speculative_draft_model_revision", "speculative_num_draft_tokens",
    "speculative_dflash_block_size", "attention_backend", "decode_attention_backend",
    "prefill_attention_backend", "page_size", "enable_dp_attention", "tp_size", "pp_size",
    "speculative_draft_window_size", "speculative_use_rejection_sampling",
    "speculative_adaptive", "enable_lora", "speculative_num_steps", "speculative_eagle_topk",
    "max_running_requests", "enable_mixed_chunk", "enable_linear_replayssm_spec",
    "mamba_radix_cache_strategy")


def _get(args: Any, name: str) -> Any:
    """A ServerArgs field, by a name READ_FIELDS lists; no default (require_fields() judged
    the arguments before anything reads them)."""
    if name not in READ_FIELDS:
        raise KeyError(f"server_args.READ_FIELDS lacks {name!r}")
    return getattr(args, name)


def missing_fields(args: Any) -> list[str]:
    """The fields of READ_FIELDS this ServerArgs lacks (an SGLang that renamed them)."""
    return [f for f in READ_FIELDS if not hasattr(args, f)]


def require_fields(args: Any) -> None:
    """Refuse a ServerArgs without every field of READ_FIELDS."""
    missing = missing_fields(args)
    if missing:
        from ddtree_sglang.sglang_plugin.contract import SUPPORTED_SGLANG

        raise DDTreeConfigError(
            f"DDTREE cannot start: SGLang's server arguments have no field(s) "
            f"{', '.join(missing)}, which DDTREE reads (renamed in this SGLang?); "
            f"ddtree-sglang supports SGLang {SUPPORTED_SGLANG}: pip install "
            f"sglang=={SUPPORTED_SGLANG}")


def budget_from_args(args: Any) -> int:
    n = _get(args, "speculative_num_draft_tokens")
    return DEFAULT_BUDGET if n is None else int(n) - 1


def drafter_config(args: Any) -> DFlashConfig:
    """The drafter's DFlash config, from a local directory or a hub ID (dflash/files.py: the
    cache, offline mode, --speculative-draft-model-revision, --download-dir)."""
    ref = _get(args, "speculative_draft_model_path")
    if not ref:
        raise DDTreeConfigError(f"DDTREE needs --speculative-draft-model-path; accepted: "
                                f"{DRAFTER_ACCEPTED}")
    try:
        path = model_dir(str(ref), _get(args, "speculative_draft_model_revision"),
                         _get(args, "download_dir"))
    except ModelNotFound as exc:
        raise DDTreeConfigError(f"--speculative-draft-model-path: {exc}; accepted: "
                                f"{DRAFTER_ACCEPTED}") from None
    try:
        return load_dflash_config(path)
    except NotADFlashCheckpoint as exc:
        raise DDTreeConfigError(f"DDTREE drafter is not a DFlash checkpoint: {exc}; "
                                f"--speculative-draft-model-path accepts {DRAFTER_ACCEPTED}") \
            from exc


def block_size_from_args(args: Any, cfg: DFlashConfig) -> int:
    override = _get(args, "speculative_dflash_block_size")
    if override is None:
        return cfg.block_size
    override = int(override)
    if not 2 <= override <= cfg.block_size:
        raise DDTreeConfigError(
            f"--speculative-dflash-block-size {override} is out of range for this drafter; "
            f"accepted: 2..{cfg.block_size} (the drafter's block_size)")
    return override


def check_budget(budget: int, block_size: int) -> None:
    # B >= L keeps the verify width N >= block_size: the draft block and a full commit fit in
    # the per-step KV reserve (2N) and in the verify-sized graph buffers.
    low = block_size - 1
    if not low <= budget <= MAX_BUDGET:
        raise DDTreeConfigError(
            f"DDTREE tree budget B = --speculative-num-draft-tokens - 1 = {budget} is out of "
            f"range; accepted: B in {low}..{MAX_BUDGET}, i.e. --speculative-num-draft-tokens "
            f"{low + 1}..{MAX_BUDGET + 1} (default {DEFAULT_BUDGET + 1})")


def _backend_errors(args: Any) -> list[str]:
    errors = []
    for flag in ("attention_backend", "decode_attention_backend", "prefill_attention_backend"):
        value = _get(args, flag)
        if value is not None and value not in TREE_BACKENDS:
            why = WHY_NOT.get(value, "it has no tree-mask verify path")
            errors.append(
                f"--{flag.replace('_', '-')} {value} cannot verify a draft tree ({why}); "
                f"accepted: {', '.join(TREE_BACKENDS)} (both run on Hopper and on "
                "Blackwell sm_120)")
    return errors


def _target_hf_config(args: Any) -> dict:
    """The target's config.json, local or by hub ID; {} where it cannot be read (SGLang
    reports a missing target itself)."""
    ref = _get(args, "model_path")
    try:
        cfg_file = model_dir(str(ref), _get(args, "revision"), _get(args, "download_dir")) \
            / "config.json" if ref else None
    except ModelNotFound:
        return {}
    if cfg_file is None or not cfg_file.is_file():
        return {}
    try:
        return json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def hybrid_reason(hf: dict) -> str | None:
    """Why a target config is a hybrid (mamba / linear attention) model, or None."""
    texts = [hf] + [hf[k] for k in ("text_config", "llm_config") if isinstance(hf.get(k), dict)]
    for cfg in texts:
        mt = str(cfg.get("model_type", "")).lower()
        if mt in HYBRID_MODEL_TYPES:
            return f"model_type {mt!r} mixes recurrent/linear-attention layers"
        types = cfg.get("layer_types") or cfg.get("layers_block_type") or []
        odd = sorted({str(t) for t in types} & HYBRID_LAYER_TYPES)
        if odd:
            return f"layer types {odd}"
    return None


def gdn_hybrid(hf: dict) -> bool:
    """Whether a target config is a hybrid whose recurrent layers are gated-delta ones."""
    texts = [hf] + [hf[k] for k in ("text_config", "llm_config") if isinstance(hf.get(k), dict)]
    return any(str(cfg.get("model_type", "")).lower() in GDN_HYBRID_MODEL_TYPES for cfg in texts)


# Target classes of SGLang 0.5.17 that cannot hand a DFlash drafter the target's features (no
# set_dflash_layers_to_capture): the text-only Qwen3.5 classes of models/qwen3_5_text.py
# (a test checks that SGLang's classes still lack it).
NO_FEATURE_CAPTURE = {"Qwen3_5ForCausalLM": "sglang/srt/models/qwen3_5_text.py",
                      "Qwen3_5MoeForCausalLM": "sglang/srt/models/qwen3_5_text.py"}


def _hybrid_errors(args: Any, hf: dict, unchecked: bool) -> list[str]:
    """A hybrid target: gated-delta ones are implemented and start under
    SGLANG_DDTREE_DEBUG=unchecked (for their GPU check), without the state-pool options whose
    verify is chain-only; text-only Qwen3.5 checkpoints, whose SGLang class captures no drafter
    features, and other recurrent layers are refused."""
    arch = next(iter(hf.get("architectures") or []), "")
    if arch in NO_FEATURE_CAPTURE:
        return [f"DDTREE (like DFLASH) needs the target's hidden states for its drafter, and "
                f"SGLang {NO_FEATURE_CAPTURE[arch]} serves {arch} without capturing them (no "
                "set_dflash_layers_to_capture); accepted: the Qwen3.5 / 3.6 vision-language "
                "checkpoints (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditional"
                "Generation) and Qwen3-Next"]
    reason = hybrid_reason(hf)
    if reason is None:
        return []
    if not gdn_hybrid(hf):
        return [f"DDTREE does not support this hybrid target ({reason}); accepted: "
                "full-attention targets, and gated-delta hybrids (Qwen3.5, Qwen3.6, Qwen3-Next) "
                f"under {DEBUG_ENV}=unchecked"]
    if not unchecked:
        return [f"DDTREE on gated-delta hybrid targets ({reason}) is implemented and awaits its "
                f"GPU check against plain SGLang; it starts with {DEBUG_ENV}=unchecked, for "
                "that check; accepted without it: full-attention targets"]
    errors = []
    if _get(args, "enable_linear_replayssm_spec"):
        errors.append("--enable-linear-replayssm-spec verifies chains only (accepted: off with "
                      "DDTREE)")
    if _get(args, "mamba_radix_cache_strategy") == "extra_buffer_lazy":
        errors.append("--mamba-radix-cache-strategy extra_buffer_lazy is not checked with "
                      "DDTREE's trees (accepted: the other strategies)")
    return errors


def sliding_window_reason(hf: dict) -> str | None:
    """Why a target config uses windowed attention (sliding or chunked), or None.

    The tree verify masks by tree index, not by each node's own depth, so a window would be
    applied at the wrong distance for tree nodes: not lossless once a sequence passes it."""
    texts = [hf] + [hf[k] for k in ("text_config", "llm_config") if isinstance(hf.get(k), dict)]
    for cfg in texts:
        windowed = sorted({str(t) for t in cfg.get("layer_types") or []
                           if "sliding" in str(t) or "chunk" in str(t)})
        if windowed:
            return f"layer types {windowed}"
        if cfg.get("attention_chunk_size"):
            return f"chunked attention (attention_chunk_size={cfg['attention_chunk_size']})"
        for key in ("sliding_window", "sliding_window_size"):
            if cfg.get(key) and cfg.get("use_sliding_window", True) is not False:
                return f"{key}={cfg[key]}"
    return None


def tap_error(taps: tuple[int, ...], hf: dict) -> str | None:
    """Why the drafter's target_layer_ids cannot be served on this target, or None (see
    `untappable_layers`: the drafter would get too few features)."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    layers = text.get("num_hidden_layers")
    if not isinstance(layers, int):
        return None
    bad = untappable_layers(taps, layers)
    if not bad:
        return None
    return (f"drafter dflash_config.target_layer_ids {list(taps)} names layers {bad} of a "
            f"{layers}-layer target; accepted: 0..{layers - 2} (SGLang cannot capture the "
            "last layer's output)")


def backend_to_default(args: Any) -> str | None:
    """The attention backend DDTREE chooses, or None when the user chose one (then validate()
    judges it, and refuses arguments without the fields DDTREE reads)."""
    if missing_fields(args):
        return None
    if any(_get(args, f) is not None for f in ("attention_backend", "decode_attention_backend",
                                                "prefill_attention_backend")):
        return None
    return DEFAULT_TREE_BACKEND


def _drafter_and_budget_errors(args: Any, hf: dict) -> list[str]:
    """The drafter, the block size, the budget and the DDTREE knobs, each judged on its own so
    that one problem does not hide the next."""
    errors: list[str] = []
    cfg = block = None
    try:
        cfg = drafter_config(args)
        block = block_size_from_args(args, cfg)
    except DDTreeConfigError as exc:
        errors.append(str(exc))
    budget = budget_from_args(args)
    low = (block or 2) - 1
    try:
        check_budget(budget, low + 1)
    except DDTreeConfigError as exc:
        errors.append(str(exc))
    try:  # the knobs, against the budget clamped into range (its own error is above)
        DDTreeSettings.from_values(min(max(budget, low), MAX_BUDGET), low + 1)
    except DDTreeConfigError as exc:
        errors.append(str(exc))
    if cfg is not None:
        taps = tap_error(cfg.target_layer_ids, hf)
        if taps:
            errors.append(taps)
    return errors


def _parallel_and_paging_errors(args: Any, unchecked: bool) -> list[str]:
    """Page size, tensor / pipeline parallelism and DP attention: what is refused, and what is
    implemented but waits for its GPU check (started only under SGLANG_DDTREE_DEBUG=unchecked,
    for that check)."""
    errors = []
    page = _get(args, "page_size")
    checked = ", ".join(map(str, CHECKED_PAGE_SIZES))
    if page is not None and int(page) not in CHECKED_PAGE_SIZES and not (
            unchecked and 1 <= int(page) <= MAX_UNCHECKED_PAGE_SIZE):
        errors.append(f"--page-size {page} is not accepted; accepted: {checked} (checked on a "
                      f"GPU against plain SGLang); sizes up to {MAX_UNCHECKED_PAGE_SIZE} are "
                      f"implemented and start with {DEBUG_ENV}=unchecked, for their GPU check")
    if _get(args, "enable_dp_attention"):
        errors.append("DDTREE does not support --enable-dp-attention (accepted: off); run one "
                      "replica per GPU, or --tp-size, instead")
    tp = _get(args, "tp_size")
    if tp not in (None, 1) and not unchecked:
        errors.append(f"--tp-size {tp} is not accepted yet; accepted: 1 (one replica per GPU); "
                      f"tensor parallelism is implemented and starts with {DEBUG_ENV}=unchecked, "
                      "for its GPU check against plain SGLang on several GPUs")
    pp = _get(args, "pp_size")
    if pp not in (None, 1):
        errors.append(f"DDTREE supports --pp-size 1 only; got {pp} (accepted: 1; use "
                      "--tp-size to split a model)")
    return errors


def validate(args: Any) -> None:
    """Raise DDTreeConfigError listing every problem found, one line each naming what is
    accepted (plugin._validate prints it and ends the launch)."""
    require_fields(args)
    errors: list[str] = []
    device = str(_get(args, "device") or "cuda")
    if not device.startswith("cuda"):
        errors.append(f"DDTREE runs on CUDA GPUs only; got --device {device} (accepted: "
                      "cuda)")
    hf = _target_hf_config(args)  # read once: a hub ID may cost a download of config.json
    errors += _drafter_and_budget_errors(args, hf)
    errors += _backend_errors(args)
    try:
        unchecked = "unchecked" in debug_flags()
    except DDTreeConfigError:  # reported with the other settings above
        unchecked = False
    errors += _parallel_and_paging_errors(args, unchecked)
    if _get(args, "speculative_draft_window_size") is not None:
        errors.append("DDTREE does not support --speculative-draft-window-size (accepted: unset)")
    if _get(args, "speculative_use_rejection_sampling"):
        errors.append("DDTREE verifies by sampling the target at every node; "
                      "--speculative-use-rejection-sampling is not supported (accepted: off)")
    if _get(args, "speculative_adaptive"):
        errors.append("DDTREE does not support --speculative-adaptive (accepted: off)")
    if _get(args, "enable_lora"):
        errors.append("DDTREE does not support LoRA adapters (accepted: --enable-lora off)")
    errors += _hybrid_errors(args, hf, unchecked)
    window = sliding_window_reason(hf)
    if window:
        errors.append(f"DDTREE does not support sliding-window or chunked attention targets "
                      f"({window}): the tree mask would apply the window at the wrong distance; "
                      "accepted: full-attention targets (or use_sliding_window false)")
    if errors:
        raise DDTreeConfigError("DDTREE cannot start:\n  - " + "\n  - ".join(errors))


def settings_from_args(args: Any) -> DDTreeSettings:
    """The settings of a server whose arguments passed validate() (the worker's process builds
    them once from the arguments SGLang hands it and its environment)."""
    require_fields(args)
    return DDTreeSettings.from_values(budget_from_args(args),
                                      block_size_from_args(args, drafter_config(args)))


def apply_defaults(args: Any) -> None:
    """Settle the fields the rest of SGLang reads (mirrors what DFLASH sets for itself)."""
    require_fields(args)
    cfg = drafter_config(args)
    block = block_size_from_args(args, cfg)
    budget = budget_from_args(args)
    fields = {}
    for flag in ("speculative_num_steps", "speculative_eagle_topk"):
        if _get(args, flag) not in (None, 1):
            logger.warning("DDTREE ignores --%s %s (uses 1)", flag.replace("_", "-"),
                           _get(args, flag))
        fields[flag] = 1
    fields["speculative_num_draft_tokens"] = budget + 1
    fields["speculative_dflash_block_size"] = block  # DDTreeSpecAlgo reads the draft width
    if _get(args, "max_running_requests") is None:
        fields["max_running_requests"] = 48
    if _get(args, "enable_mixed_chunk"):
        logger.warning("DDTREE disables --enable-mixed-chunk")
        fields["enable_mixed_chunk"] = False
    from ddtree_sglang.sglang_plugin import patches  # SGLang's names: not in validate()'s path

    patches.set_server_fields(args, fields)
