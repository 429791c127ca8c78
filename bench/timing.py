"""GPU timing helpers for the kernel benchmarks: CUDA events around eager calls, or replays of a CUDA graph
(which takes the launch overhead out, as the engine's decode and prefill graphs do)."""
from __future__ import annotations

from typing import Callable

import torch

from engine.graphs import capture


def cuda_time(fn: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of fn() over `iters` runs, CUDA events around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def graph_time(fn: Callable[[], object], calls: int = 10, replays: int = 20) -> float:
    """Milliseconds per fn() when `calls` of them replay in one CUDA graph (no launch overhead)."""
    graph, _ = capture(lambda: [fn() for _ in range(calls)], None)
    return cuda_time(graph.replay, iters=replays) / calls
