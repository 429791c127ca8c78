"""The decode step's inputs, kept per slot row on the host and gathered for the live rows at once;
and the prefill's, packed from the admitted segments' sources.

A row's token, position, source range and adapter change only at admission (set here) and by one
step (the position +1, the token chosen by selection, written straight into `tokens`), so a step
builds its [6, N] input with one numpy gather instead of walking every segment.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.scheduler import Segment
from engine.selection import Selection, StepOutcome

TOKEN, STEP, ROW, SRC_START, SRC_LEN, ADAPTER = range(6)  # rows of the table (and of DecodeBatch.inputs)
SRC_ID, SRC_POSITION, POOL_TOKEN, SRC_ADAPTER = range(4)  # rows of a prefill's packed tokens


def prefill_inputs(segments: list[Segment]) -> tuple[np.ndarray, np.ndarray]:
    """The segments' sources packed back to back: tokens [4, n] int64, per token its id, its position in
    its source (0-based), its source-pool entry and its adapter slot; cu_seqlens [B + 1] int64 offsets."""
    lengths = np.array([len(s.src_ids) for s in segments], dtype=np.int64)
    cu_seqlens = np.zeros(len(segments) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu_seqlens[1:])
    n = int(cu_seqlens[-1])
    tokens = np.empty((4, n), dtype=np.int64)
    tokens[SRC_ID] = np.fromiter((t for s in segments for t in s.src_ids), dtype=np.int64, count=n)
    tokens[SRC_POSITION] = np.arange(n) - np.repeat(cu_seqlens[:-1], lengths)
    tokens[POOL_TOKEN] = np.repeat([s.src_start for s in segments], lengths) + tokens[SRC_POSITION]
    tokens[SRC_ADAPTER] = np.repeat([s.adapter_slot for s in segments], lengths)
    return tokens, cu_seqlens


class StepInputs:
    def __init__(self, rows_total: int):
        self.table = np.zeros((6, rows_total), dtype=np.int64)  # [6, R] one column per slot row
        self.table[ROW] = np.arange(rows_total)
        self.tokens = self.table[TOKEN]  # [R] view: the token each row feeds next (selection writes it)
        self._live = np.zeros(0, dtype=np.int64)
        self._version = -1

    def admit(self, seg: Segment) -> None:
        """A segment's rows start at decoder position 0 with the decoder start token."""
        rows = seg.rows
        self.table[TOKEN, rows] = seg.search.next_tokens()
        self.table[STEP, rows] = 0
        self.table[SRC_START, rows] = seg.src_start
        self.table[SRC_LEN, rows] = len(seg.src_ids)
        self.table[ADAPTER, rows] = seg.adapter_slot

    def live(self, segments: list[Segment], version: int) -> np.ndarray:
        """The running segments' rows in segment order, [N] (recomputed only when `version` changed)."""
        if version != self._version:
            self._live = np.fromiter((r for seg in segments for r in seg.rows), dtype=np.int64)
            self._version = version
        return self._live

    def gather(self, live: np.ndarray) -> np.ndarray:
        """Shape: live [N]; out [6, N] (a copy)."""
        return self.table[:, live]

    def advance(self, live: np.ndarray) -> None:
        """Every live row moved one position on."""
        self.table[STEP, live] += 1


@dataclass
class DecodeBatch:
    """Every live row of one decode step, in segment order."""

    segments: list[Segment]
    version: int  # the scheduler's version of the running set these segments are
    live: np.ndarray  # [N] the rows' slot-table rows, in segment order
    # [6, N] int64 on the device, one row each (TOKEN ... ADAPTER above): the token each row feeds; its
    # position in the decoder sequence (0-based); its slot-table row; its segment's first source-pool
    # token; its segment's source length; its adapter slot (0: the base model)
    inputs: torch.Tensor
    logit_rows: torch.Tensor | None  # [N'] rows past step 0 (the others' token is forced); None: all
    src_bound: int  # a power of two >= every row's source length (plans cross-attention's split)
    adapter_slots: set[int]  # the distinct adapter slots of the rows, 0 left out (empty: base model only)
    max_step: int  # the largest decoder position a row feeds at this step


@dataclass
class InFlight:
    """A step launched on the device whose selection the host has not applied yet."""

    batch: DecodeBatch
    selection: Selection
    outcome: StepOutcome | None = None  # the selection read on the host (_read_selection); None: not yet
