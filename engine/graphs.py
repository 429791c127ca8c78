"""CUDA graphs of the decode step (decoder layers + LM head), one per row-count bucket.

A decode step is a few hundred small launches; replayed as one graph it costs a fraction of
their launch overhead. Shapes are static per bucket: a step of n rows runs the graph of the
smallest bucket >= n, the extra rows pointing at the slot table's scratch row. A graph is also
specific to the bound on source lengths it was planned with (cross-attention's work split), so
graphs are keyed by (row bucket, source bound, LoRA sites), the bound a power of two. A step with
any adapter row runs a graph that applies the LoRA kernel at the sites installed adapters adapt
(none: the base-model graph): each row reads its adapter slot from the inputs on the device, so
one graph serves any mix of adapters, including ones loaded after the capture (the stacks are
static tensors). Inputs are copied into one static buffer; the graph writes KV into the slot
table in place and logits into its static output. Graphs need the CUDA kernels (the reference
ops read lengths on the host, which a graph cannot).
Degrade, don't die: if a capture fails, the reason is logged once and every step runs eagerly.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger("engine")

INPUTS = 6  # rows of the packed input: tokens, steps, slot rows, source starts, source lengths, adapters


class DecodeGraphs:
    def __init__(self, step_fn: Callable[[torch.Tensor, int, frozenset], torch.Tensor], max_rows: int,
                 padding: list[int], device: torch.device):
        """step_fn(inputs [6, n], source bound, LoRA sites) -> logits [n, V]; `padding`: a filler row's
        inputs (its adapter slot 0)."""
        self.step_fn = step_fn
        self.buckets = sorted({min(1 << i, max_rows) for i in range(max_rows.bit_length() + 1)})
        self.inputs = torch.tensor(padding, dtype=torch.long, device=device)[:, None].repeat(1, max_rows).contiguous()
        self.padding = self.inputs.clone()  # [6, max_rows] filler rows
        self.graphs: dict[tuple[int, int, frozenset], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.enabled = True

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, inputs: torch.Tensor, src_bound: int, sites: frozenset) -> torch.Tensor | None:
        """Logits [n, V] for packed device inputs [6, n] whose source lengths are <= src_bound, with
        LoRA at `sites` (empty: no row has an adapter). None when graphs are off (run eagerly)."""
        if not self.enabled:
            return None
        n = inputs.shape[1]
        b = self.bucket(n)
        self.inputs[:, :n].copy_(inputs)
        if b > n:
            self.inputs[:, n:b].copy_(self.padding[:, n:b])
        key = (b, src_bound, sites)
        if key not in self.graphs and not self._try_capture(key):
            return None
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:n]

    def capture_upto(self, n: int, src_bound: int, sites: frozenset) -> int:
        """Capture the graph of every bucket up to n's for (src_bound, sites) not held yet; how many."""
        top = self.bucket(min(n, self.buckets[-1]))
        captured = 0
        for key in [(b, src_bound, sites) for b in self.buckets if b <= top]:
            if key in self.graphs or not self.enabled:
                continue
            self.inputs[:, :key[0]].copy_(self.padding[:, :key[0]])  # filler rows: the step writes only scratch
            captured += self._try_capture(key)
        return captured

    def _try_capture(self, key: tuple[int, int, frozenset]) -> bool:
        try:
            self.graphs[key] = self._capture(*key)
            return True
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run eagerly
            log.error("CUDA graph capture failed for %d rows (%s); decode steps run eagerly from now on",
                      key[0], exc)
            self.enabled = False
            return False

    def _capture(self, b: int, src_bound: int, sites: frozenset) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        static = self.inputs[:, :b]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: the same step run eagerly (writes the same KV)
            self.step_fn(static, src_bound, sites)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.step_fn(static, src_bound, sites)
        log.info("captured the decode step for %d rows, sources up to %d tokens, LoRA at %d sites", b, src_bound,
                 len(sites))
        return graph, logits
