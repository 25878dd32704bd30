"""One way to time a GPU call for the micro-benchmarks: as the server runs it, from a CUDA graph.

The server replays its verify and tree stages from CUDA graphs, so a micro-benchmark that timed
eager launches would add Python and launch overhead the server never pays.
"""

from __future__ import annotations

import statistics
from typing import Callable


def graph_replay_ms(fn: Callable[[], object], iters: int, warm_replays: int = 10) -> float:
    """Median milliseconds of one replay of `fn` captured in a CUDA graph.

    `fn` runs three times eagerly first (Triton compiles, cuBLAS picks its kernels), on a side
    stream as graph capture requires; then `warm_replays` untimed replays, then `iters` timed ones.
    """
    import torch

    from ddtree_sglang.kernels.graphed import capture_graph

    graph = capture_graph(fn, None, warmups=3)
    for _ in range(warm_replays):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
