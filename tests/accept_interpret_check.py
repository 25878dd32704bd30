"""The fused Triton acceptance walk against decode_step.accept_stage, run by the Triton
interpreter on the CPU (set TRITON_INTERPRET=1 before importing triton; used by
test_kernels.py)."""
import torch

from ddtree_sglang.tree.stages import accept_stage
from ddtree_sglang.kernels.choice import check_accept_kernel, random_verified_trees
from ddtree_sglang.kernels.accept import accept_stage_triton


def main() -> None:
    gen = torch.Generator().manual_seed(1)
    cases = 0
    for bs, n, depth, width, vocab in [(4, 17, 15, 16, 3), (3, 9, 3, 4, 2), (2, 40, 6, 7, 4),
                                       (1, 1, 15, 16, 5), (5, 33, 15, 8, 2)]:
        for _ in range(3):
            case = random_verified_trees(bs, n, depth, vocab, gen, "cpu")
            ref = accept_stage(*case, depth, width)
            out = accept_stage_triton(*case, depth, width)
            for name, a, b in zip(("commit_lens", "accept_index", "feature_rows", "bonus",
                                   "tokens"), ref, out):
                assert a.dtype == b.dtype and torch.equal(a, b), (bs, n, depth, name, a, b)
            cases += 1
    assert check_accept_kernel("cpu") is None  # the worker's startup check passes
    print("ACCEPT OK", cases)


if __name__ == "__main__":
    main()
