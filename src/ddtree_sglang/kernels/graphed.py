"""Replay a fixed-shape tensor function as a CUDA graph, one capture per batch size.

DDTree's per-step tree work (build, layout, acceptance) is a few hundred small kernels: launched
one by one they cost more host time than the GPU spends on them, which is what made an
independent engine port of DDTree slower than the chain.  The functions are written with fixed
shapes and no host synchronisation, so they can be captured once per batch size and replayed.

A server captures every batch size it will use at startup and then `freeze()`s: a batch size
seen later is padded to the next captured one (rows are independent, so the first rows of the
padded result are the answer) and nothing is captured while serving.  On the CPU, or if
capture fails, the function simply runs eagerly.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

logger = logging.getLogger(__name__)


class GraphedFunction:
    """`fn(*tensors) -> tuple of tensors` whose inputs and outputs all lead with the batch
    dimension (outputs may flatten it: [bs * k, ...]), replayed from CUDA graphs.

    Inputs are copied into static buffers and the outputs are copied out of the graph, so
    callers own what they get.  All graphs of one instance share a memory pool (one batch
    size's intermediates, not one per size); that is safe because replays are sequential on one
    stream and nothing is read from the pool after its replay's outputs are copied."""

    def __init__(self, fn: Callable[..., tuple], name: str, enabled: bool = True,
                 max_graphs: int = 256) -> None:
        self.fn, self.name, self.enabled, self.max_graphs = fn, name, enabled, max_graphs
        self.frozen = False
        self._graphs: dict[tuple, tuple] = {}
        self._pool = None

    def freeze(self) -> None:
        """Capture nothing more: unseen batch sizes pad to a captured one, or run eagerly."""
        self.frozen = True

    @property
    def captured_sizes(self) -> list[int]:
        return sorted({key[0][0][0] for key in self._graphs})

    def __call__(self, *inputs: torch.Tensor) -> tuple:
        if not self.enabled or not inputs[0].is_cuda or torch.cuda.is_current_stream_capturing():
            return tuple(self.fn(*inputs))
        bs = inputs[0].shape[0]
        entry = self._graphs.get(_key(inputs, bs))
        if entry is not None:
            return self._replay(entry, inputs, bs, bs)
        padded = next((s for s in self.captured_sizes
                       if s > bs and _key(inputs, s) in self._graphs), None)
        if padded is not None and (self.frozen or len(self._graphs) >= self.max_graphs):
            return self._replay(self._graphs[_key(inputs, padded)], inputs, bs, padded)
        if self.frozen or len(self._graphs) >= self.max_graphs:
            return tuple(self.fn(*inputs))
        try:
            entry = self._capture(inputs)
        except Exception as exc:  # noqa: BLE001 - fall back to eager for good
            logger.warning("%s: CUDA graph capture failed (%s); running eagerly", self.name, exc)
            self.enabled = False
            return tuple(self.fn(*inputs))
        self._graphs[_key(inputs, bs)] = entry
        return self._replay(entry, inputs, bs, bs)

    @staticmethod
    def _replay(entry: tuple, inputs: tuple, bs: int, padded: int) -> tuple:
        graph, static_in, static_out = entry
        for dst, src in zip(static_in, inputs):
            dst[:bs].copy_(src)
            if padded > bs:  # keep padding rows valid: repeat the first real row
                dst[bs:].copy_(src[:1].expand_as(dst[bs:]))
        graph.replay()
        return tuple(t[: bs * (t.shape[0] // padded)].clone() for t in static_out)

    def _capture(self, inputs: tuple) -> tuple:
        static_in = [t.clone() for t in inputs]
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        static_out: list = []
        graph = capture_graph(lambda: static_out.append(self.fn(*static_in)), self._pool,
                              keep=lambda: static_out.clear())
        return graph, static_in, static_out[-1]


def capture_graph(fn: Callable[[], object], pool, keep: Callable[[], None] | None = None,
                  warmups: int = 2) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of `fn()` (fixed shapes, no host synchronisation) in memory pool `pool`
    (None: a pool of its own): `warmups` calls on a side stream (kernels compiled, allocator
    settled) and the capture, thread-local so that other serving threads' CUDA calls are
    unaffected; `keep()` runs before the capture (to drop the warm-up calls' results)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    if keep is not None:
        keep()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        fn()
    return graph


def _key(inputs: tuple, bs: int) -> tuple:
    """Graph key of `inputs` with their batch dimension set to `bs`."""
    return tuple(((bs, *t.shape[1:]), t.dtype) for t in inputs)
