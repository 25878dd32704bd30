"""DDTREE's tree verify attention, installed in place of SGLang's Triton extend kernel for
tree verifies (kernels/tree_attention.py: the cached prefix without a mask, split over KV
blocks, then the tree tokens under their mask, in one online softmax).

A verify query sees its whole prefix, so only the [n, n] tree block of SGLang's mask is ever
read (SGLang's own masked kernel skips the prefix part too).  Calls that are not a tree verify
the kernel computes exactly as SGLang's (no mask, a windowed or masked prefix, sinks, score
mods, an LSE asked for, a capped score, scaled or paged KV) go to SGLang's kernel unchanged.
The worker compares the kernel with SGLang's and with a float32 reference on its GPU at
startup and keeps SGLang's if they differ (`check_verify_attention`).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

# Keyword values of a tree verify whose prefix every query sees (anything else: SGLang's call).
_SPLIT_REQUIRES = {"lse_extend": None, "skip_prefix": False, "skip_extend": False,
                   "skip_prefix_custom_mask": True, "sinks": None, "score_mod": None,
                   "window_kv_offsets": None}


def splittable(args: dict) -> bool:
    """Whether a bound extend_attention_fwd call is a tree verify whose prefix and tree parts
    can be computed apart: a custom mask whose prefix part is not applied (every query sees the
    whole prefix)."""
    if args.get("custom_mask") is None:
        return False
    if any(args.get(name, value) is not value for name, value in _SPLIT_REQUIRES.items()):
        return False
    window = args.get("sliding_window_size", -1)
    return window is None or window < 0


def kernel_computes(args: dict) -> bool:
    """Whether kernels/tree_attention.py computes a splittable call as SGLang's kernel would:
    KV in the query's dtype at scale 1, no logit cap, no length temperature, pages of 1."""
    def one(x) -> bool:
        return x is None or (isinstance(x, (int, float)) and x == 1)

    return (splittable(args) and args["k_buffer"].dtype == args["q_extend"].dtype
            and not args.get("logit_cap") and (args.get("xai_temperature_len") or -1) <= 0
            and args.get("page_size", 1) == 1 and args.get("aux_tensors") is None
            and one(args.get("k_scale")) and one(args.get("v_scale")))


def kernel_attention(single: Callable, merge: Callable, signature: inspect.Signature,
                     min_requests: int = 1, tile: dict | None = None) -> Callable:
    """An extend_attention_fwd with `single`'s signature that sends every tree verify
    `kernel_computes` (of at least `min_requests` requests) to the two-launch tree-attention
    kernel (kernels/tree_attention.py: split prefix + masked tree in one online softmax).
    `merge` is unused: the kernel merges inside its second launch.  `tile`: the kernel's
    block_m / block_n / num_warps (default: its own)."""
    from ddtree_sglang.kernels.tree_attention import tree_verify_attention

    tile = dict(tile or {})

    def attend(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        call = dict(bound.arguments)
        if not kernel_computes(call) or call["qo_indptr"].shape[0] - 1 < min_requests:
            return single(*args, **kwargs)
        q = call["q_extend"]
        return tree_verify_attention(
            q, call["k_extend"], call["v_extend"], call["o_extend"], call["k_buffer"],
            call["v_buffer"], call["qo_indptr"], call["kv_indptr"], call["kv_indices"],
            call["custom_mask"], call["mask_indptr"], int(call["max_len_extend"]),
            call["sm_scale"] or q.shape[-1] ** -0.5, **tile)

    attend.__wrapped__ = single
    return attend


# The verify attention variant -> the wrapper of SGLang's extend kernel it installs ("single",
# SGLang's own call, installs nothing).
VARIANTS = {"kernel": kernel_attention}


def random_tree_ancestors(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, n] bool, row i = node i's ancestors and itself, for a random tree rooted at 0."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i]]
    return anc


def verify_case(bs: int, n: int, prefix: int, heads: int, kv_heads: int, dim: int, device,
                dtype, ancestors: torch.Tensor | None | str = "random",
                seed: int = 0) -> tuple[dict, torch.Tensor]:
    """Keyword arguments of one extend_attention_fwd verify: bs requests of `prefix` cached
    tokens and n new ones each, attending with `ancestors` ([n, n] bool, "random" for a random
    tree, None for no mask: the causal chain).  Returns them and the [n, prefix + n]
    visibility of one request."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    if isinstance(ancestors, str):
        ancestors = random_tree_ancestors(n, gen)
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    visible = torch.cat([torch.ones(n, prefix, dtype=torch.bool),
                         tril if ancestors is None else ancestors], dim=1)
    args = dict(
        q_extend=rnd(bs * n, heads, dim), k_extend=rnd(bs * n, kv_heads, dim),
        v_extend=rnd(bs * n, kv_heads, dim),
        o_extend=torch.zeros(bs * n, heads, dim, device=device, dtype=dtype),
        k_buffer=rnd(bs * prefix, kv_heads, dim), v_buffer=rnd(bs * prefix, kv_heads, dim),
        qo_indptr=(torch.arange(bs + 1) * n).to(device),
        kv_indptr=(torch.arange(bs + 1) * prefix).to(device=device, dtype=torch.int32),
        kv_indices=torch.randperm(bs * prefix, generator=gen).to(device),
        custom_mask=None if ancestors is None else visible.reshape(-1).repeat(bs).to(device),
        is_causal=True,
        mask_indptr=None if ancestors is None else
        (torch.arange(bs + 1) * n * (prefix + n)).to(device),
        max_len_extend=n, k_scale=1.0, v_scale=1.0, sm_scale=dim ** -0.5)
    return args, visible


def reference_attention(args: dict, rows: torch.Tensor, bs: int, prefix: int) -> torch.Tensor:
    """Plain PyTorch masked attention of a `verify_case` (float32): the kernels' reference."""
    q, k, v = args["q_extend"].float(), args["k_extend"].float(), args["v_extend"].float()
    n, heads = rows.shape[0], q.shape[1]
    group = heads // k.shape[1]
    kb = args["k_buffer"].float()[args["kv_indices"].long()].view(bs, prefix, -1, q.shape[-1])
    vb = args["v_buffer"].float()[args["kv_indices"].long()].view(bs, prefix, -1, q.shape[-1])
    keys = torch.cat([kb, k.view(bs, n, -1, q.shape[-1])], 1).repeat_interleave(group, 2)
    vals = torch.cat([vb, v.view(bs, n, -1, q.shape[-1])], 1).repeat_interleave(group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.view(bs, n, heads, -1), keys) * args["sm_scale"]
    scores = scores.masked_fill(~rows.to(q.device).view(1, 1, n, -1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vals)
    return out.reshape(bs * n, heads, -1)


def check_verify_attention(single: Callable, merge: Callable, signature: inspect.Signature,
                           device, dtype=torch.bfloat16, make: Callable = kernel_attention
                           ) -> str | None:
    """Why `make(single, merge, signature)` (a VARIANTS wrapper) cannot replace the single call
    on this device (None if it can): on a random tree verify both must agree with each other
    and with the float32 reference."""
    try:
        bs, n, prefix = 3, 17, 40
        tol = 2e-2 if dtype != torch.float32 else 1e-4
        args, rows = verify_case(bs, n, prefix, 8, 2, 64, device, dtype)
        single(**args)
        expected = args["o_extend"].float().clone()
        reference = reference_attention(args, rows, bs, prefix)
        args["o_extend"].zero_()
        make(single, merge, signature, min_requests=1)(**args)
        got = args["o_extend"].float()
        if not (got - expected).abs().max() <= tol:
            return f"it differs from the single call by {(got - expected).abs().max():.3g}"
        if not (got - reference).abs().max() <= tol:
            return f"it differs from the float32 reference by {(got - reference).abs().max():.3g}"
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the single call
        return f"{type(exc).__name__}: {str(exc)[:200]}"
