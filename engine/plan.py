"""The selection plan of a batch: which selection mode each segment takes and where its rows are.

A plan holds while the batch's segments do (the scheduler's `version`), with one exception: a segment's
</s> ban (min_new_tokens) ends after a known number of steps, and the plan then moves its bans on
(`Plan.with_bans`) without looking at any segment. A segment that left the table after the batch was made is
planned like the others (its rows compute on, its picks are dropped by the engine), so that a batch made on the
device stays decided on the device.

Built with numpy from per-row tables (`RowModes`: each row's segment's Search.plan_code and min_new_tokens, set at
admission) and the batch rows' decoder positions (a segment's first row's: the tokens it was fed before this step):
on ragged traffic a new plan is made every few steps for ~1,000 segments, and a Python pass per segment took ~2.5
ms of the host's time a plan on the GPU machine.

A group's rows are the batch's own rows: the step's logits hold every batch row, and rows at decoder length 1
(whose token is forced) are in no group, so no step copies the others' logits rows out from among them.

Legend: N rows of the batch, n rows of a group.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from math import inf
from types import ModuleType

import numpy as np
import torch

from engine.devices import upload
from engine.search import HISTORY, SAMPLED


class RowModes:
    """What a plan reads of each slot row's segment, written when the segment is admitted (StepInputs.admit), so
    that `build` reads a batch's segments from its rows in numpy. Shape: each [R]."""

    def __init__(self, rows_total: int):
        self.code = np.zeros(rows_total, dtype=np.int64)  # its search's plan_code
        self.min_new = np.zeros(rows_total, dtype=np.int64)  # its min_new_tokens
        self.lane = np.zeros(rows_total, dtype=np.int64)  # the row's place among its segment's rows (0: the first)

    def admit(self, rows: np.ndarray, segments: list, widths: list[int]) -> None:
        """Segments of `widths` rows each took `rows` [sum(widths)], segment after segment."""
        self.code[rows] = np.repeat([seg.search.plan_code for seg in segments], widths)
        self.min_new[rows] = np.repeat([seg.search.ctx.options.min_new_tokens for seg in segments], widths)
        starts = np.cumsum(widths) - widths
        self.lane[rows] = np.arange(rows.size) - np.repeat(starts, widths)


@dataclass
class RowGroup:
    """The segments of one selection mode and where their rows are, with device copies of the indices."""

    segments: list = field(default_factory=list)  # the members, in order
    index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [n] their batch (logits) rows
    slot_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [n] their slot-table rows
    ban_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [n] launches banning </s>
    processed: list = field(default_factory=list)  # (segment, position of its first row in `index`): history
    index_t: torch.Tensor | None = None  # [n] int64 device copies
    slot_rows_t: torch.Tensor | None = None
    banned_t: torch.Tensor | None = None  # positions in `index` that ban </s> at this launch (None: none)
    ban_mask_t: torch.Tensor | None = None  # [n] int64, 1 where the row bans </s> (topk_logprobs' ban)
    processed_rows_t: torch.Tensor | None = None  # [rows of `processed`] int64: their logits rows, in order
    processed_at_t: torch.Tensor | None = None  # [rows of `processed`] int64: their positions in `index`
    first: int = -1  # index[0] when `index` is one run of consecutive logits rows (a slice of them), else -1

    @classmethod
    def of(cls, segments: list, index: np.ndarray, slot_rows: np.ndarray, ban_steps: np.ndarray,
           history: np.ndarray, width: int, device: torch.device) -> "RowGroup":
        """Segments of `width` rows each; history [len(segments)] bool: whose history processors act (they ban
        </s> themselves, so their ban_steps are 0)."""
        at = np.flatnonzero(history)
        group = cls(segments, index, slot_rows, np.where(np.repeat(history, width), 0, ban_steps),
                    [(segments[i], int(i) * width) for i in at])
        if index.size and int(index[-1]) - int(index[0]) == index.size - 1:  # distinct and increasing: one run
            group.first = int(index[0])
        group.index_t = upload(index, device)
        group.slot_rows_t = upload(slot_rows, device)
        group._set_bans(0, device)
        if at.size:
            rows_at = (at[:, None] * width + np.arange(width)).reshape(-1)
            group.processed_at_t = upload(rows_at, device)
            group.processed_rows_t = upload(index[rows_at], device)
        return group

    @property
    def rows(self) -> int:
        return len(self.index)

    def _set_bans(self, elapsed: int, device: torch.device) -> None:
        """The </s> bans at the plan's launch `elapsed` (0: its first): every member advances one step a launch."""
        mask = self.ban_steps > elapsed
        banned = np.flatnonzero(mask)
        self.banned_t = upload(banned, device) if banned.size else None
        self.ban_mask_t = upload(mask.astype(np.int64), device) if banned.size else None

    def with_bans(self, elapsed: int, device: torch.device) -> "RowGroup":
        """A copy of the group with its bans at launch `elapsed` (the other tensors shared)."""
        if not self.rows:
            return self
        group = copy.copy(self)
        group._set_bans(elapsed, device)
        return group

    def next_ban_change(self, elapsed: int) -> float:
        """The first launch after `elapsed` at which a row's ban ends (inf: none does)."""
        later = self.ban_steps[self.ban_steps > elapsed]
        return int(later.min()) if later.size else inf

    def is_all(self, logits: torch.Tensor) -> bool:
        """Whether the group's rows are all the logits rows, in order."""
        return self.first == 0 and self.rows == logits.shape[0]

    def gather(self, logits: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        """The group's rows: a slice of the logits where they are one run of rows (the step loop orders a batch's
        segments by selection mode for that: on mixed traffic the copies took ~8% of the GPU's step), else one
        gather. Rows belong to one group only, so callers may edit them in place."""
        if self.first >= 0:
            return logits[self.first:self.first + self.rows]
        # gather_rows, not logits[rows] nor index_select: those copied [n, V] rows at a fraction of the bandwidth
        return ops.gather_rows(logits, self.index_t)


@dataclass
class Plan:
    """How a batch's segments split into selection modes; valid until `valid_until` (a launch count), when a
    segment's first step or its </s> ban ends."""

    version: int  # the scheduler's version of the running set it was made for
    made_at: int  # the Selector's launch count at its first launch
    valid_until: float
    greedy: RowGroup
    sampled: list  # segments drawn from (one row each)
    sampled_rows: np.ndarray  # [len(sampled)] int64 their slot rows
    sampled_index_t: torch.Tensor | None  # [len(sampled)] int64 on the device: their logits rows
    beams: dict[int, RowGroup]  # num_beams -> group
    forced: list  # segments at decoder length 1 (no logits rows), still in the table
    forced_at: list[int]  # [len(forced)] the batch row of each one's first row
    unstepped: bool  # some batch rows are in no group (decoder length 1): their next tokens start at 0

    def groups(self) -> tuple[RowGroup, ...]:
        return (self.greedy, *self.beams.values())

    def until(self, elapsed: int) -> float:
        """valid_until for the plan's bans at launch `elapsed`: the next launch at which one ends."""
        if self.forced:
            return self.made_at + 1
        return self.made_at + min(group.next_ban_change(elapsed) for group in self.groups())

    def with_bans(self, steps: int, device: torch.device) -> "Plan":
        """The same plan at launch count `steps`, with only the </s> bans moved on: when a segment's ban ends,
        the rows stay where they were, so nothing is walked per segment (on ragged traffic that happens at
        nearly every step)."""
        elapsed = steps - self.made_at
        plan = replace(self, greedy=self.greedy.with_bans(elapsed, device),
                       beams={nb: group.with_bans(elapsed, device) for nb, group in self.beams.items()})
        plan.valid_until = plan.until(elapsed)
        return plan


def build(segments: list, version: int, live: np.ndarray, positions: np.ndarray, modes: RowModes, launch: int,
          device: torch.device) -> Plan:
    """The plan of a batch: its segments in order, live [N] their slot rows (as when the batch was made), positions
    [R] every slot row's decoder position at this step (the step inputs' table), modes the rows' segments' codes
    (their rows keep them until admitted again, which a batch's rows are not while it runs); `launch` is the
    Selector's launch count now. A segment is past its first step where its rows' position is past 0: a segment
    that left while its first step was in flight is so in a step made on the device from that one, though its
    search never took that step's outcome."""
    first = np.flatnonzero(modes.lane[live] == 0)  # each segment's first row in the batch
    heads = live[first]
    code, min_new = modes.code[heads], modes.min_new[heads]
    width = code >> 2
    steps = positions[heads]  # the tokens each was fed before this step
    stepped = steps > 0  # past its first step: its rows are selected from their logits
    ban_steps = np.maximum(min_new - steps, 0)
    history = (code & HISTORY) != 0

    def members(mask: np.ndarray) -> tuple[np.ndarray, list]:
        at = np.flatnonzero(mask & stepped)
        return at, [segments[i] for i in at]

    def group(mask: np.ndarray, nb: int) -> RowGroup:
        at, segs = members(mask)
        batch_rows = (first[at, None] + np.arange(nb)).reshape(-1)  # [n]
        return RowGroup.of(segs, batch_rows, live[batch_rows], np.repeat(ban_steps[at], nb), history[at], nb, device)

    greedy = group((width == 1) & ((code & SAMPLED) == 0), 1)
    sampled_at, sampled = members((width == 1) & ((code & SAMPLED) != 0))
    beams = {int(nb): group(width == nb, int(nb)) for nb in np.unique(width[stepped]) if nb > 1}
    forced_at = np.flatnonzero(~stepped)
    forced = [segments[i] for i in forced_at if segments[i].rows]  # else it left before its first step
    plan = Plan(version, launch, inf, greedy, sampled, live[first[sampled_at]],
                upload(first[sampled_at], device) if sampled else None, beams, forced,
                [int(first[i]) for i in forced_at if segments[i].rows], bool(forced_at.size))
    plan.valid_until = plan.until(0)
    return plan
