"""The device part of a step's selection as a CUDA graph: captured once a plan holds, replayed while it does.

At one sentence a step's selection is ~10 launches and torch ops whose Python (argument checks, launches,
allocations) takes about as long on the host as the decode step on the GPU, so on a slower host the host
bounds the step (one sentence, beam 4: docs/performance.md). While a plan (engine/selection.py) holds, everything the
selection reads is at fixed addresses: the plan's index tensors, the slot table's beam scores and history,
the decode graph's logits. Only the beam steps' inputs from the host (BeamStepInputs.meta: lengths and
at_max move every step) change: they go into static buffers before each replay. So the device part is
captured once and then costs one replay a step.

Captured only where it pays: plans of greedy and beam rows (no sampling, no first steps, no history
processors), at most MAX_ROWS logits rows (a larger step keeps the GPU
busy longer than its selection's Python takes), and from a plan's SETTLE-th launch on, so that plans that
last a step or two (segments coming and going) never pay a capture (~1 ms and a device sync).
Degrade, don't die: a failed capture is logged once and selection runs eagerly from then on.
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from engine.beam_step import BeamStepInputs

log = logging.getLogger("engine")

MAX_ROWS = 64
SETTLE = 3  # a plan's launches before its capture: the first ones run eagerly


class SelectionGraph:
    """The captured device part of the current plan's selection (one at a time); the engine thread's own."""

    def __init__(self) -> None:
        self.enabled = True
        self.captures = 0  # how many captures so far (tests, logs)
        self.plan = None  # the plan the launch count and the graph are for
        self.launches = 0  # launches of that plan so far
        self.key: tuple | None = None  # (logits address, logits shape) the graph was captured on
        self.graph: torch.cuda.CUDAGraph | None = None
        self.metas: list[torch.Tensor] = []  # static device copies of each beam group's BeamStepInputs.meta
        self.out: tuple | None = None  # the device part's result: (payload, next tokens), static

    @staticmethod
    def takes(plan, logits: torch.Tensor) -> bool:
        """Whether this plan's selection can be captured (and is worth it) at this step size."""
        groups = (plan.greedy, *plan.beams.values())
        return (not plan.forced and logits.is_cuda and 0 < logits.shape[0] <= MAX_ROWS and not plan.sampled
                and not any(group.processed for group in groups))

    def run(self, plan, logits: torch.Tensor, steps: list[BeamStepInputs],
            device_part: Callable[[list[torch.Tensor]], tuple]) -> tuple | None:
        """The device part's (payload, next tokens) for this step by replay, capturing it first where due;
        None: run it eagerly. `device_part(static metas)` enqueues the selection reading the beam groups'
        BeamStepInputs.meta from the given device tensors; `steps` are this step's."""
        if not self.enabled or not self.takes(plan, logits):
            return None
        if plan is not self.plan:
            self.plan, self.launches, self.graph, self.out = plan, 0, None, None
        self.launches += 1
        if self.launches < SETTLE:
            return None
        key = (logits.data_ptr(), tuple(logits.shape))
        metas = [step.meta() for step in steps]
        if self.graph is None:
            if self.launches > SETTLE or not self._capture(key, metas, logits.device, device_part):
                return None  # this plan's capture failed, or its logits moved (eager decode steps): eager
        elif self.key != key:
            self.graph, self.out = None, None
            return None
        for static, meta in zip(self.metas, metas):
            static.copy_(torch.from_numpy(meta), non_blocking=True)  # in stream order, before the replay reads it
        self.graph.replay()
        return self.out

    def _capture(self, key: tuple, metas: list[np.ndarray], device: torch.device,
                 device_part: Callable[[list[torch.Tensor]], tuple]) -> bool:
        """Capture device_part on static meta buffers (nothing runs: the first replay is this step's).
        Not torch.cuda.graph: that empties the allocator's and the pinned host caches at every capture."""
        statics = [torch.empty(len(meta), dtype=torch.int64, device=device) for meta in metas]
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = device_part(statics)
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager selection from now on
            log.error("CUDA graph capture of the selection failed (%s); it runs eagerly from now on", exc)
            self.enabled, self.graph, self.out = False, None, None
            return False
        torch.cuda.current_stream(device).wait_stream(side)
        self.key, self.graph, self.metas, self.out = key, graph, statics, out
        self.captures += 1
        return True
