"""Small random target + DFlash drafter pairs, for tests and demos that need no weights."""

from __future__ import annotations

import torch

from ddtree_sglang.dflash.config import DFlashConfig
from ddtree_sglang.reference.drafter import DFlashDrafter


def tiny_pair(vocab: int = 96, hidden: int = 64, target_layers: int = 4, draft_layers: int = 1,
              block_size: int = 8, seed: int = 0, head_scale: float = 4.0):
    """A random Qwen3 target (float32, SDPA) and a random drafter tapping layers 1 and 2."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=target_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, attn_implementation="sdpa",
    )
    target = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(head_scale)  # sharper distributions, fewer argmax near-ties
    dcfg = DFlashConfig(
        hidden_size=hidden, num_hidden_layers=draft_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=hidden // 4, intermediate_size=2 * hidden,
        vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=1_000_000.0, block_size=block_size,
        mask_token_id=vocab - 1, target_layer_ids=(1, 2), num_target_layers=target_layers,
    )
    drafter = DFlashDrafter(dcfg).eval()
    return target, drafter
