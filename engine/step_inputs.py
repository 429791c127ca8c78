"""The decode step's inputs, kept per slot row on the host and gathered for the live rows at once;
and the prefill's, packed from the admitted segments' sources.

A row's token, position, source range and adapter change only at admission (set here) and by one
step (the position +1, the token chosen by selection, written straight into `tokens`), so a step
builds its inputs with one numpy gather instead of walking every segment.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from typing import Generic, TypeVar

import numpy as np
import torch

from engine.plan import RowModes
from engine.scheduler import Segment
from engine.selection import Selection

SRC_ID, SRC_POSITION, POOL_TOKEN, SRC_ADAPTER = range(4)  # rows of a prefill's packed tokens

Array = TypeVar("Array", np.ndarray, torch.Tensor)


@dataclass(frozen=True)
class RowInputs(Generic[Array]):
    """What each of N decoder rows feeds one step, as named [N] int64 views over one [6, N] buffer (numpy on
    the host, a tensor on the device): one buffer so that a step's inputs are gathered, uploaded and copied
    into a captured graph's static inputs at once."""

    buffer: Array  # [6, N]; the views below are its rows, in this order

    FIELDS = ("token", "position", "row", "src_start", "src_len", "adapter")

    @property
    def token(self) -> Array:
        """The token the row feeds (the decoder start, the forced language token, then selection's picks)."""
        return self.buffer[0]

    @property
    def position(self) -> Array:
        """Its position in the decoder sequence (0-based): where its self-attention KV is appended."""
        return self.buffer[1]

    @property
    def row(self) -> Array:
        """Its slot-table row (the scratch row for a graph's filler rows)."""
        return self.buffer[2]

    @property
    def src_start(self) -> Array:
        """Its segment's first source-pool token (the cross-attention KV)."""
        return self.buffer[3]

    @property
    def src_len(self) -> Array:
        """Its segment's source length in tokens."""
        return self.buffer[4]

    @property
    def adapter(self) -> Array:
        """Its adapter slot (0: the base model)."""
        return self.buffer[5]

    @property
    def size(self) -> int:
        return self.buffer.shape[1]

    def columns(self, index) -> "RowInputs[Array]":
        """The rows at `index` (a slice is a view, an index array a copy). The copy is made row-major: numpy's
        `buffer[:, index]` comes out column-major, whose [N] views the kernels refuse as not contiguous."""
        if isinstance(index, slice):
            return RowInputs(self.buffer[:, index])
        return RowInputs(np.take(self.buffer, index, axis=1))

    @staticmethod
    def filled(n: int, device: torch.device, **values: int) -> "RowInputs[torch.Tensor]":
        """n device rows alike, each field's value given by name."""
        column = torch.tensor([values[name] for name in RowInputs.FIELDS], dtype=torch.long, device=device)
        return RowInputs(column[:, None].repeat(1, n).contiguous())


def prefill_inputs(segments: list[Segment]) -> tuple[np.ndarray, np.ndarray]:
    """The segments' sources packed back to back: tokens [4, n] int64, per token its id, its position in
    its source (0-based), its source-pool entry and its adapter slot; cu_seqlens [B + 1] int64 offsets."""
    lengths = np.array([len(s.src_ids) for s in segments], dtype=np.int64)
    cu_seqlens = np.zeros(len(segments) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu_seqlens[1:])
    n = int(cu_seqlens[-1])
    tokens = np.empty((4, n), dtype=np.int64)
    tokens[SRC_ID] = np.fromiter(chain.from_iterable(s.src_ids for s in segments), dtype=np.int64, count=n)
    tokens[SRC_POSITION] = np.arange(n) - np.repeat(cu_seqlens[:-1], lengths)
    tokens[POOL_TOKEN] = np.repeat([s.src_start for s in segments], lengths) + tokens[SRC_POSITION]
    tokens[SRC_ADAPTER] = np.repeat([s.adapter_slot for s in segments], lengths)
    return tokens, cu_seqlens


# From ~50 rows on (16 heads, short sources: ops.attention_plan) a step's cross-attention gives each row a warp of its
# own, which a warp for a beam segment's rows then replaces; at fewer rows the group changes nothing but the decode
# graph's key. The rule starts past 32 rows, with the graphs' 64-row bucket, so that no bucket holds graphs of both
# kinds for traffic of one beam width.
SHARED_SOURCE_MIN_ROWS = 33


def rows_per_source(widths: list[int]) -> int:
    """For a step's segments of `widths` rows each (consecutive, each segment's rows reading its one source): how
    many consecutive rows, from the first, always read one source (their widths' common divisor; 1 below
    SHARED_SOURCE_MIN_ROWS rows)."""
    if sum(widths) < SHARED_SOURCE_MIN_ROWS:
        return 1
    return math.gcd(*widths)


class StepInputs:
    """Every slot row's inputs for its next step, on the host."""

    def __init__(self, rows_total: int):
        self.table = RowInputs(np.zeros((6, rows_total), dtype=np.int64))  # one column per slot row [R]
        self.table.row[:] = np.arange(rows_total)
        self.tokens = self.table.token  # [R] view: the token each row feeds next (selection writes it)
        # [R] each row's search's max_length (host only; the one-row searches' SingleRows reads it too)
        self.max_length = np.zeros(rows_total, dtype=np.int64)
        self.modes = RowModes(rows_total)  # [R] what the selection plan reads of each row's segment
        self._live = np.zeros(0, dtype=np.int64)
        self._version = -1
        self.rows_per_source = 1  # of the rows `live` last returned (rows_per_source(), below)

    def admit(self, segments: list[Segment]) -> np.ndarray:
        """The segments' rows start at decoder position 0 with the decoder start token (one assignment a
        field for all of them: five a segment took ~12 us, 12 ms for a batch of 1,024). Returns their rows,
        segment after segment [n]."""
        widths = [len(seg.rows) for seg in segments]
        n, table = sum(widths), self.table
        rows = np.fromiter(chain.from_iterable(seg.rows for seg in segments), dtype=np.int64, count=n)
        table.token[rows] = np.fromiter(chain.from_iterable(seg.search.next_tokens() for seg in segments),
                                        dtype=np.int64, count=n)
        table.position[rows] = 0
        table.src_start[rows] = np.repeat([seg.src_start for seg in segments], widths)
        table.src_len[rows] = np.repeat([len(seg.src_ids) for seg in segments], widths)
        table.adapter[rows] = np.repeat([seg.adapter_slot for seg in segments], widths)
        self.max_length[rows] = np.repeat([seg.search.ctx.max_length for seg in segments], widths)
        self.modes.admit(rows, segments, widths)
        return rows

    def live(self, segments: list[Segment], version: int) -> np.ndarray:
        """The running segments' rows in segment order, [N] (recomputed only when `version` changed)."""
        if version != self._version:
            self._live = np.fromiter((r for seg in segments for r in seg.rows), dtype=np.int64)
            self.rows_per_source = rows_per_source([len(seg.rows) for seg in segments])
            self._version = version
        return self._live

    def gather(self, live: np.ndarray) -> RowInputs[np.ndarray]:
        """Shape: live [N]; out [N] per field (a copy)."""
        return self.table.columns(live)

    def steps_left(self, live: np.ndarray, position: np.ndarray) -> int:
        """The most steps a row of `live` may take after the step that feeds it `position`, before its search's
        max_length ends it: that step makes the sequence position + 2 long (<= 0: every row's segment ends with
        it, greedy, sampled or beam; a row whose segment left computes on past it). Shape: live, position [N]."""
        return int((self.max_length[live] - 2 - position).max())

    def advance(self, live: np.ndarray) -> None:
        """Every live row moved one position on."""
        self.table.position[live] += 1


@dataclass
class DecodeBatch:
    """Every live row of one decode step, in segment order."""

    segments: list[Segment]
    version: int  # the scheduler's version of the running set these segments are
    admissions: int  # the scheduler's admission count when it was made: its segments are every one running then
    live: np.ndarray  # [N] the rows' slot-table rows, in segment order
    inputs: RowInputs[torch.Tensor]  # [N] per field, on the device
    src_bound: int  # a power of two >= every row's source length (plans cross-attention's split)
    rows_per_source: int  # runs of this many consecutive rows share a source (StepInputs.rows_per_source)
    adapter_slots: set[int]  # the distinct adapter slots of the rows, 0 left out (empty: base model only)
    max_step: int  # the largest decoder position a row feeds at this step
    steps_left: int  # the most steps a row may take after this one before max_length ends it (<= 0: none)


@dataclass
class InFlight:
    """A step launched on the device whose selection the host has not applied yet."""

    batch: DecodeBatch
    selection: Selection
