"""Reading a z-lab DFlash drafter's config.json, with clear errors for what is not one.

Fields are read where z-lab checkpoints put them: `dflash_config.{target_layer_ids,
mask_token_id}`, with `block_size` and `mask_token_id` also accepted at the top level (older
files).  `target_layer_ids` is required: the evenly-spaced fallback is wrong for most published
checkpoints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class NotADFlashCheckpoint(ValueError):
    """The drafter path does not hold a DFlash block-diffusion drafter."""


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    attention_bias: bool = False

    @property
    def draft_depth(self) -> int:
        """Draft horizon L = block_size - 1: the deepest tree level."""
        return self.block_size - 1


def _rope_theta(raw: dict[str, Any]) -> float:
    if "rope_theta" in raw:
        return float(raw["rope_theta"])
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return 1_000_000.0


def parse_dflash_config(raw: dict[str, Any], where: str = "config.json") -> DFlashConfig:
    archs = raw.get("architectures") or []
    dflash = raw.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise NotADFlashCheckpoint(f"{where}: dflash_config must be an object, got {dflash!r}")
    if not any("DFlash" in a for a in archs) and not dflash:
        raise NotADFlashCheckpoint(
            f"{where}: not a DFlash drafter (architectures={archs}, no dflash_config); "
            "expected architectures ['DFlashDraftModel'] with dflash_config.target_layer_ids "
            "and mask_token_id, as in z-lab's *-DFlash-b16 checkpoints"
        )
    layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
    if not layer_ids or not all(isinstance(i, int) and i >= 0 for i in layer_ids):
        raise NotADFlashCheckpoint(
            f"{where}: dflash_config.target_layer_ids must be a non-empty list of layer "
            f"indices, got {layer_ids!r}"
        )
    mask_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
    if not isinstance(mask_id, int) or mask_id < 0:
        raise NotADFlashCheckpoint(
            f"{where}: dflash_config.mask_token_id (or top-level mask_token_id) must be a "
            f"token id, got {mask_id!r}"
        )
    block_size = dflash.get("block_size", raw.get("block_size", 16))
    if not isinstance(block_size, int) or block_size < 2:
        raise NotADFlashCheckpoint(f"{where}: block_size must be an int >= 2, got {block_size!r}")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size", "vocab_size") if k not in raw]
    if missing:
        raise NotADFlashCheckpoint(f"{where}: missing fields {missing}")
    heads = int(raw["num_attention_heads"])
    return DFlashConfig(
        hidden_size=int(raw["hidden_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        intermediate_size=int(raw["intermediate_size"]),
        vocab_size=int(raw["vocab_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(raw),
        block_size=block_size,
        mask_token_id=mask_id,
        target_layer_ids=tuple(layer_ids),
        num_target_layers=raw.get("num_target_layers"),
        attention_bias=bool(raw.get("attention_bias", False)),
    )


def untappable_layers(taps: tuple[int, ...] | list[int], n_layers: int) -> list[int]:
    """The tapped target layers outside 0..n_layers-2.  SGLang captures layer k's output at the
    input of layer k + 1, so the last layer is never captured (and transformers' last hidden
    state is taken after the final norm): a drafter cannot be served with such taps."""
    return [t for t in taps if not 0 <= t <= n_layers - 2]


def load_dflash_config(path: str | Path) -> DFlashConfig:
    """Parse `<path>/config.json` (or a config.json path) as a DFlash drafter config."""
    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else p
    if not cfg_file.is_file():
        raise NotADFlashCheckpoint(f"{path}: no config.json found; expected a DFlash drafter "
                                   "directory with config.json and model.safetensors")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise NotADFlashCheckpoint(f"{cfg_file}: not valid JSON ({exc})") from exc
    return parse_dflash_config(raw, where=str(cfg_file))
