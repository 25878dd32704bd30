"""The Triton float32 logsumexp against torch.logsumexp in float32, run by the Triton interpreter
on the CPU (set TRITON_INTERPRET=1 before importing triton; used by test_kernels.py)."""
import torch

from ddtree_sglang.kernels.logsumexp import logsumexp_reference, logsumexp_triton


def main() -> None:
    g = torch.Generator().manual_seed(0)
    cases = 0
    for shape, dtype in [((2, 3, 1000), torch.bfloat16), ((1, 5, 4097), torch.float16),
                         ((4, 7), torch.float32), ((3, 64), torch.bfloat16)]:
        x = (torch.randn(shape, generator=g) * 8).to(dtype)
        if x.shape[-1] > 10:
            x[..., ::3] = float("-inf")  # masked vocabulary entries
        out = logsumexp_triton(x, block=256)
        ref = logsumexp_reference(x)
        assert out.dtype == torch.float32 and out.shape == ref.shape
        assert torch.allclose(out, ref, rtol=1e-6, atol=1e-5), (shape, (out - ref).abs().max())
        cases += 1
    big = torch.full((1, 300), -1e4, dtype=torch.float16)
    big[0, 7] = 60000.0  # far apart: the running rescale must not overflow
    assert torch.allclose(logsumexp_triton(big, block=128), logsumexp_reference(big))
    from ddtree_sglang.kernels.choice import _logsumexp_agrees

    assert _logsumexp_agrees(1000, "cpu", torch.bfloat16)  # the worker's startup check passes
    print("LOGSUMEXP OK", cases + 1)


if __name__ == "__main__":
    main()
