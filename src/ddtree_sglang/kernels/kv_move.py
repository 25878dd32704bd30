"""Move each request's accepted tree path to its committed KV positions, in one launch.

After a verify step the accepted nodes' K/V sit in the tree's slots; the committed sequence
needs them in slots 0..k of the request's block.  SGLang's generic move compacts the moves of
the whole batch into a fixed-size list whose unused tail copies slot 0 onto itself; at batch 64
(1,024 entries x 72 buffers) that tail alone costs milliseconds per step.  Here one program
handles one request, one buffer and one byte tile: it loads the
rows that actually move (accepted, and not already in place), waits for every thread, then
stores, so a path that reads a slot another of its moves writes is still copied correctly.

Reference: `move_rows_reference`, the same "all reads, then all writes" semantics in PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _move_rows_kernel(data_ptrs, strides, tgt_ptr, src_ptr, W: tl.constexpr,
                      WP: tl.constexpr, TILE: tl.constexpr):
    r = tl.program_id(0)
    buf = tl.program_id(1)
    tile = tl.program_id(2)
    stride = tl.load(strides + buf)
    base = tl.load(data_ptrs + buf).to(tl.pointer_type(tl.uint8))
    j = tl.arange(0, WP)
    ok = j < W
    src = tl.load(src_ptr + r * W + j, mask=ok, other=0)
    tgt = tl.load(tgt_ptr + r * W + j, mask=ok, other=0)
    off = tile * TILE + tl.arange(0, TILE)
    m = (ok & (src != tgt))[:, None] & (off < stride)[None, :]
    vals = tl.load(base + src[:, None] * stride + off[None, :], mask=m)
    tl.debug_barrier()  # every read of this request's rows happens before any write
    tl.store(base + tgt[:, None] * stride + off[None, :], vals, mask=m)


def move_rows_triton(data_ptrs: torch.Tensor, strides: torch.Tensor, max_stride: int,
                     tgt: torch.Tensor, src: torch.Tensor, tile: int = 512) -> None:
    """Copy row src[r, j] to row tgt[r, j] of every buffer, where they differ.

    data_ptrs [num_buffers] uint64 base addresses, strides [num_buffers] bytes per row,
    tgt/src [bs, W] int64 row indices; the rows of different requests must be disjoint.
    """
    bs, width = tgt.shape
    if bs == 0:
        return
    grid = (bs, int(data_ptrs.numel()), triton.cdiv(max_stride, tile))
    _move_rows_kernel[grid](data_ptrs, strides, tgt.contiguous(), src.contiguous(), W=width,
                            WP=triton.next_power_of_2(width), TILE=tile)


def move_rows_reference(buffers: list[torch.Tensor], tgt: torch.Tensor,
                        src: torch.Tensor) -> None:
    """PyTorch reference: per buffer, read every moving row, then write them."""
    moving = src != tgt
    t, s = tgt[moving], src[moving]
    for buf in buffers:
        buf[t] = buf[s].clone()
