"""The Triton tree kernel against the PyTorch builder, run by the Triton interpreter on the CPU
(set TRITON_INTERPRET=1 before importing triton; used by test_kernels.py).  Small shapes keep
the interpreter fast; the GPU benchmark covers B up to 64."""
import torch

from ddtree_sglang.kernels.tree_build import build_draft_tree_triton
from ddtree_sglang.tree import build_draft_tree

CASES = [(1, 3, 5, 6), (2, 6, 40, 16), (2, 5, 8, 12), (1, 1, 9, 4), (3, 4, 300, 8)]


def main() -> None:
    for bs, depth, vocab, budget in CASES:
        g = torch.Generator().manual_seed(bs * 100 + budget)
        for logits in (torch.randn(bs, depth, vocab, generator=g) * 3,
                       (torch.randn(bs, depth, vocab, generator=g)).round(),  # many ties
                       torch.zeros(bs, depth, vocab)):  # all ties
            ref = build_draft_tree(logits, budget)
            out = build_draft_tree_triton(logits, budget)
            for name in ("tokens", "parents", "depths"):
                assert torch.equal(getattr(ref, name), getattr(out, name)), (name, bs, depth, vocab, budget)
            assert torch.allclose(ref.scores, out.scores)
    print("KERNEL OK", len(CASES) * 3)


if __name__ == "__main__":
    main()
