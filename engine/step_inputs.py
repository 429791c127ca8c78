"""The decode step's inputs, kept per slot row on the host and gathered for the live rows at once.

A row's token, position, source range and adapter change only at admission (set here) and by one
step (the position +1, the token chosen by selection, written straight into `tokens`), so a step
builds its [6, N] input with one numpy gather instead of walking every segment.
"""
from __future__ import annotations

import numpy as np

from engine.scheduler import Segment

TOKEN, STEP, ROW, SRC_START, SRC_LEN, ADAPTER = range(6)  # rows of the table (and of DecodeBatch.inputs)


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
