"""Compare our verify layout and acceptance with SGLang 0.5.17's own EAGLE tree kernels.

Run in a fresh process with TRITON_INTERPRET=1 (so the Triton kernels run on the CPU); used by
test_sglang_oracles.py.  Each tree is re-expressed in EAGLE's (parent_list, selected_index)
encoding, fed to sgl_build_tree_kernel_triton and verify_tree_greedy_triton, and the outputs are
compared with ours.  Prints "ORACLE OK <cases>" on success.
"""
import sys

import torch

from ddtree_sglang.tree.acceptance import accept_tree
from ddtree_sglang.tree.verify_layout import build_verify_layout, full_mask
from ddtree_sglang.tree.builder import build_draft_tree
from sglang.srt.speculative.eagle_utils import (
    TreeMaskMode, sgl_build_tree_kernel_triton, verify_tree_greedy_triton,
)


def eagle_encoding(parents: list[int], topk: int):
    n = len(parents)
    counts = [0] * n
    selected = [0] * n
    for i in range(1, n):
        p = parents[i]
        selected[i] = p * topk + counts[p]  # chunk p holds p's children; chunk 0 = root
        counts[p] += 1
    parent_list = [0] + [selected[p] for p in range(1, n)]
    return parent_list, selected[1:]


def main() -> None:
    cases = 0
    for seed, (bs, depth, vocab, budget) in enumerate(
        [(1, 3, 5, 6), (2, 15, 40, 12), (3, 6, 9, 20), (2, 15, 100, 31)]
    ):
        g = torch.Generator().manual_seed(seed)
        tree = build_draft_tree(torch.randn(bs, depth, vocab, generator=g) * 2, budget)
        seq_lens = torch.randint(1, 9, (bs,), generator=g)
        roots = torch.randint(0, vocab, (bs,), generator=g)
        lay = build_verify_layout(tree, roots, seq_lens)
        n = budget + 1
        topk = n
        pl, sel = zip(*[eagle_encoding(lay.tree_parents[b].tolist(), topk) for b in range(bs)])
        parent_list = torch.tensor(pl, dtype=torch.long)
        selected = torch.tensor(sel, dtype=torch.long)
        total = int(seq_lens.sum())
        mask = torch.ones(total * n + bs * n * n, dtype=torch.bool)
        positions = torch.empty(bs * n, dtype=torch.long)
        ri, rn, rs = torch.full((3, bs, n), -1, dtype=torch.long)
        sgl_build_tree_kernel_triton(parent_list, selected, seq_lens, mask, positions, ri, rn, rs,
                                     topk, depth, n, TreeMaskMode.FULL_MASK)
        assert torch.equal(positions, lay.positions), (positions, lay.positions)
        assert torch.equal(ri, lay.retrieve_index)
        assert torch.equal(rn, lay.retrieve_next_token), (rn, lay.retrieve_next_token)
        assert torch.equal(rs, lay.retrieve_next_sibling), (rs, lay.retrieve_next_sibling)
        assert torch.equal(mask, full_mask(lay.ancestors, seq_lens, total))
        # Greedy verify: target argmax per node, forced to follow random paths often.
        cand = lay.draft_tokens.view(bs, n)
        for trial in range(4):
            choice = torch.randint(0, vocab, (bs, n), generator=g)
            follow = torch.rand(bs, n, generator=g) < 0.8
            # make the target agree with a random child where possible
            nxt = lay.retrieve_next_token
            child_tok = cand.gather(1, nxt.clamp(min=0))
            choice = torch.where(follow & (nxt >= 0), child_tok, choice)
            predicts = torch.full((bs * n,), -1, dtype=torch.int32)
            accept_index = torch.full((bs, depth + 1), -1, dtype=torch.int32)
            accept_num = torch.zeros(bs, dtype=torch.int32)
            verify_tree_greedy_triton(predicts, accept_index, accept_num, cand, ri, rn, rs, choice)
            ours = accept_tree(cand, lay.tree_parents, lay.tree_depths, choice, max_depth=depth)
            assert torch.equal(accept_num.long() + 1, ours.accept_len), (accept_num, ours.accept_len)
            theirs_path = accept_index.long() - (torch.arange(bs) * n)[:, None]
            theirs_path = torch.where(accept_index >= 0, theirs_path, -1)
            assert torch.equal(theirs_path, ours.accept_path), (theirs_path, ours.accept_path)
            last = (ours.accept_path.gather(1, (ours.accept_len - 1)[:, None]).squeeze(1)
                    + torch.arange(bs) * n)
            assert torch.equal(predicts.long()[last], ours.bonus)
            cases += 1
    print("ORACLE OK", cases)


if __name__ == "__main__":
    sys.exit(main())
