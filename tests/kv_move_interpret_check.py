"""The Triton KV move kernel against its PyTorch reference, run by the Triton interpreter on the
CPU (set TRITON_INTERPRET=1 before importing triton; used by test_kernels.py)."""
import torch

from ddtree_sglang.kernels.kv_move import move_rows_reference, move_rows_triton


def main() -> None:
    g = torch.Generator().manual_seed(0)
    cases = 0
    for bs, width, rows_per_req, strides in [(3, 4, 6, [16, 16, 8]), (2, 16, 17, [64, 64]),
                                             (1, 5, 5, [24])]:
        for _ in range(4):
            buffers = [torch.randint(0, 255, (bs * rows_per_req + 3, s), generator=g,
                                     dtype=torch.uint8) for s in strides]
            base = torch.arange(bs).view(bs, 1) * rows_per_req + 3
            # each request: targets 0..width-1 of its block, sources a random permutation of its
            # rows (reads of rows that other moves of the same request write included)
            tgt = base + torch.arange(width)
            src = torch.stack([torch.randperm(rows_per_req, generator=g)[:width]
                               for _ in range(bs)]) + base
            keep = torch.rand(bs, width, generator=g) < 0.3
            src = torch.where(keep, tgt, src)
            ref = [b.clone() for b in buffers]
            move_rows_reference(ref, tgt, src)
            ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
            move_rows_triton(ptrs, torch.tensor(strides), max(strides), tgt, src, tile=16)
            for a, b in zip(buffers, ref):
                assert torch.equal(a, b), (bs, width, strides)
            cases += 1
    from ddtree_sglang.kernels.choice import check_kv_move_kernel

    assert check_kv_move_kernel("cpu") is None  # the worker's startup check passes
    print("KV MOVE OK", cases)


if __name__ == "__main__":
    main()
