"""The tree-verify attention kernel (kernels/tree_attention.py) run by the Triton
interpreter on the CPU (TRITON_INTERPRET=1 is set by test_kernels.py): equal to its float32
reference for ragged prefixes (empty ones too), random trees, grouped heads, several row blocks
and split counts; through the server's wrapper, equal to SGLang's own masked kernel; calls it
cannot compute exactly go to SGLang's kernel untouched.

On a GPU (`python tests/tree_attention_interpret_check.py --device cuda`, from
scripts/gpu_run.sh kernel) the same cases run compiled in bfloat16, plus Qwen3-8B verify shapes
(32 heads over 8 KV heads, head dim 128) at batch 1, 8 and 64."""
import argparse
import inspect

import torch

from ddtree_sglang.kernels.tree_attention import reference_tree_attention, tree_verify_attention
from ddtree_sglang.sglang_plugin import sglang_api as sg
from ddtree_sglang.sglang_plugin.verify_attention import (check_verify_attention,
                                                          kernel_attention, random_tree_ancestors)


def ragged_case(prefixes: list[int], n: int, heads: int, kv_heads: int, dim: int,
                seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """extend_attention_fwd arguments of a tree verify with one random tree and prefix length
    per request; SGLang's flat mask layout ([n, prefix + n] per request)."""
    gen = torch.Generator().manual_seed(seed)
    bs, total = len(prefixes), sum(prefixes)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    masks = [torch.cat([torch.ones(n, p, dtype=torch.bool), random_tree_ancestors(n, gen)], 1)
             for p in prefixes]
    case = dict(
        q_extend=rnd(bs * n, heads, dim), k_extend=rnd(bs * n, kv_heads, dim),
        v_extend=rnd(bs * n, kv_heads, dim), o_extend=torch.zeros(bs * n, heads, dim),
        k_buffer=rnd(total + 7, kv_heads, dim), v_buffer=rnd(total + 7, kv_heads, dim),
        qo_indptr=torch.arange(bs + 1) * n,
        kv_indptr=torch.tensor([0] + prefixes).cumsum(0).to(torch.int32),
        kv_indices=torch.randperm(total + 7, generator=gen)[:total],
        custom_mask=torch.cat([m.reshape(-1) for m in masks]),
        mask_indptr=torch.tensor([0] + [n * (p + n) for p in prefixes]).cumsum(0),
        max_len_extend=n, sm_scale=dim ** -0.5)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


# (prefix lengths, tree size, heads, kv heads, head dim, prefix splits[, tile])
CASES = [([3], 5, 4, 2, 16, None), ([40, 0, 129], 17, 8, 2, 32, None),
         ([200, 7], 16, 4, 1, 16, 3), ([70], 33, 4, 4, 24, 5), ([0], 4, 2, 2, 16, 2),
         # one split: the fused single launch (prefix and tree in one program)
         ([40, 0, 129], 17, 8, 2, 32, 1), ([0, 3], 4, 2, 2, 16, 1),
         # other tiles than the default (kernels.tree_attention.default_tile): 128-row blocks
         # (33 queries x 4 heads = 132 rows), 64-key steps, 8 warps
         ([90, 5], 33, 8, 2, 16, 3, dict(block_m=128, block_n=64)), ([90, 5], 33, 8, 2, 16, 1,
         dict(block_m=128, block_n=32)), ([70, 33], 9, 8, 2, 16, 2, dict(block_n=64)),
         ([70, 33], 9, 8, 2, 16, 1, dict(block_n=64, num_warps=8)),
         # the default's 128-row block: 17 queries x 4 heads = 68 rows, 8 requests
         ([11 * i for i in range(8)], 17, 8, 2, 16, 2)]
# Qwen3-8B verify shapes (GPU only): batch 1 (many splits), 8, 64 (fused, one split)
GPU_CASES = [([1000], 16, 32, 8, 128, None), ([300 + 97 * i for i in range(8)], 33, 32, 8, 128,
             None), ([200 + 13 * i for i in range(64)], 16, 32, 8, 128, None),
             ([300 + 97 * i for i in range(8)], 33, 32, 8, 128, None,
              dict(block_m=128, block_n=64)),
             ([200 + 13 * i for i in range(64)], 17, 32, 8, 128, None,
              dict(block_m=128, block_n=32)),
             ([1000], 16, 32, 8, 128, None, dict(block_n=64)),
             ([200 + 13 * i for i in range(64)], 16, 32, 8, 128, None,
              dict(block_n=64, num_warps=8))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    device = parser.parse_args().device
    dtype, tol = (torch.float32, 1e-4) if device == "cpu" else (torch.bfloat16, 2e-2)
    cases = 0
    for prefixes, n, heads, kv_heads, dim, splits, *block in CASES + (
            GPU_CASES if device == "cuda" else []):
        args = ragged_case(prefixes, n, heads, kv_heads, dim, cases, device, dtype)
        tree_verify_attention(**args, splits=splits, **(block[0] if block else {}))
        ref = reference_tree_attention(**{k: v for k, v in args.items()
                                          if k not in ("o_extend", "max_len_extend")})
        err = (args["o_extend"].float() - ref).abs().max()
        assert err < tol, (prefixes, n, float(err))
        cases += 1
    try:
        tree_verify_attention(**ragged_case([3], 4, 2, 2, 16), block_m=96)
        raise AssertionError("block_m=96 was accepted")
    except ValueError as exc:
        assert "accepted: block_m in [64, 128], block_n in [32, 64]" in str(exc), exc
    # the server's wrapper against SGLang's own masked kernel (the worker's startup check)
    single = sg.extend_attention_fwd
    merge = sg.merge_state_triton
    signature = inspect.signature(single)
    why = check_verify_attention(single, merge, signature, device, dtype, make=kernel_attention)
    assert why is None, why
    # calls the kernel cannot compute exactly reach SGLang's kernel with their arguments
    calls = []

    def recording(*a, **k):
        calls.append(k)

    args = ragged_case([4], 4, 2, 1, 16)
    wrapped = kernel_attention(recording, merge, signature)
    for change in ({"logit_cap": 30.0}, {"custom_mask": None}, {"k_scale": 0.5}):
        wrapped(**{**args, "is_causal": True, "k_scale": 1.0, "v_scale": 1.0, **change})
    assert len(calls) == 3 and calls[0]["logit_cap"] == 30.0 and calls[2]["k_scale"] == 0.5
    kernel_attention(recording, merge, signature, min_requests=2)(
        **{**args, "is_causal": True, "k_scale": 1.0, "v_scale": 1.0})
    assert len(calls) == 4
    print("TREE ATTENTION OK", cases)


if __name__ == "__main__":
    main()
