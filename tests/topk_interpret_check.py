"""The Triton top-k + logsumexp against torch.topk and torch.logsumexp in float32, run by the
Triton interpreter on the CPU (set TRITON_INTERPRET=1 before importing triton; used by
test_kernels.py)."""
import torch

from ddtree_sglang.kernels.topk import is_valid_top_k, top_log_probs_triton


def main() -> None:
    g = torch.Generator().manual_seed(0)
    cases = 0
    for shape, k, chunk, dtype in [((2, 3, 1000), 16, 256, torch.bfloat16),
                                   ((1, 2, 4097), 33, 512, torch.float16),
                                   ((4, 300), 1, 128, torch.float32),
                                   ((2, 130), 64, 64, torch.bfloat16)]:
        x = (torch.randn(shape, generator=g) * 6).to(dtype)
        if shape[-1] > 500:
            x[..., ::5] = float("-inf")  # masked vocabulary entries
        lp, ids = top_log_probs_triton(x, k, chunk=chunk)
        assert lp.shape == ids.shape == (*shape[:-1], k) and lp.dtype == torch.float32
        assert is_valid_top_k(x, k, lp, ids), (shape, k)
        cases += 1
    tied = torch.zeros(2, 700, dtype=torch.bfloat16)  # every logit equal
    lp, ids = top_log_probs_triton(tied, 20, chunk=256)
    assert is_valid_top_k(tied, 20, lp, ids)
    bad = top_log_probs_triton(tied, 20, chunk=256)[1].clone()
    bad[0, 1] = bad[0, 0]  # a repeated id is not a top-k
    assert not is_valid_top_k(tied, 20, lp, bad)
    from ddtree_sglang.kernels.choice import _topk_agrees

    assert _topk_agrees(1000, 32, "cpu", torch.bfloat16)  # the worker's startup check passes
    print("TOPK OK", cases + 1)


if __name__ == "__main__":
    main()
