"""A DFlash block-diffusion drafter in plain PyTorch, loading z-lab format checkpoints.

The drafter has no embedding and no LM head of its own: the block [bonus, MASK x (bs-1)] is
embedded with the target's embedding and its outputs go through the target's lm_head.  The
context enters every layer as keys and values only ("KV injection"): the target's hidden states
at the tapped layers are concatenated, projected by `fc`, normalised by `hidden_norm`, and each
layer's own k_proj / v_proj turn them into extra keys and values.  Attention is non-causal over
[context || block].
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ddtree_sglang.dflash.config import DFlashConfig, load_dflash_config


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [*positions.shape, head_dim] (Qwen3's default rotary embedding)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, t, d]; cos/sin: [b, t, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, block: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        b, q_len, _ = block.shape
        kv_in = torch.cat([ctx, block], dim=1)
        kv_len = kv_in.shape[1]
        q = self.q_norm(self.q_proj(block).view(b, q_len, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_len, self.kv_heads, self.head_dim))
        v = self.v_proj(kv_in).view(b, kv_len, self.kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = apply_rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = apply_rope(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        mask = None if attn_mask is None else attn_mask.unsqueeze(1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.mlp = nn.ModuleDict(dict(
            gate_proj=nn.Linear(h, cfg.intermediate_size, bias=False),
            up_proj=nn.Linear(h, cfg.intermediate_size, bias=False),
            down_proj=nn.Linear(cfg.intermediate_size, h, bias=False),
        ))

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, attn_mask)
        h = self.post_attention_layernorm(x)
        m = self.mlp
        return x + m["down_proj"](F.silu(m["gate_proj"](h)) * m["up_proj"](h))


class DFlashDrafter(nn.Module):
    """forward(target_hidden [b, ctx, taps*H], block_embeds [b, q, H], positions [b, ctx+q])
    -> [b, q, H] final-normed hidden states (apply the target's lm_head to rows 1..q-1)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(target_hidden))

    def forward(self, target_hidden: torch.Tensor, block_embeds: torch.Tensor,
                positions: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """attn_mask: optional bool [b, q, ctx+q], True = attend (used for packed training)."""
        ctx = self.project_context(target_hidden)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta,
                                block_embeds.dtype)
        x = block_embeds
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, attn_mask)
        return self.norm(x)

    # -- checkpoint I/O in the z-lab layout ------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "DFlashDrafter":
        from safetensors.torch import load_file

        cfg = load_dflash_config(path)
        model = cls(cfg)
        state = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            state.update(load_file(str(f)))
        if not state:
            raise FileNotFoundError(f"{path}: no *.safetensors weights")
        state = {k.removeprefix("model."): v for k, v in state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path}: weights do not match the DFlash layout; "
                             f"missing={missing[:5]} unexpected={unexpected[:5]}")
        return model.to(device=device, dtype=dtype).eval()

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                        extra_config: dict | None = None) -> None:
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.config
        raw = dict(
            architectures=["DFlashDraftModel"], model_type="qwen3",
            hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
            rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, hidden_act="silu",
            attention_bias=cfg.attention_bias, tie_word_embeddings=False,
            max_position_embeddings=(extra_config or {}).get("max_position_embeddings", 4096),
            layer_types=["full_attention"] * cfg.num_hidden_layers,
            block_size=cfg.block_size, num_target_layers=cfg.num_target_layers,
            dflash_config=dict(target_layer_ids=list(cfg.target_layer_ids),
                               mask_token_id=cfg.mask_token_id),
            torch_dtype=str(dtype).removeprefix("torch."),
        )
        raw.update(extra_config or {})
        (out / "config.json").write_text(json.dumps(raw, indent=2))
        state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(out / "model.safetensors"))


