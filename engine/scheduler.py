"""Admission into the slot table, and the bookkeeping of jobs and their segments.

A job (one request) holds one or more segments (source sentences). Each segment is admitted on
its own, first come first served, when the table has its rows (`num_beams`) and source tokens;
nothing is evicted mid-segment. A job's future resolves when its last segment finishes.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.errors import DeadlineExceeded, EngineError
from engine.lora import AdapterRegistry
from engine.options import Translation
from engine.search import Search
from engine.slots import SlotTable


class JobFuture(Future):
    """The future of a job: list[Translation] in segment order. `started_at`: time.monotonic()
    when the job's first segment took rows (None before), so callers can tell waiting from work."""

    started_at: float | None = None


@dataclass(eq=False)
class Job:
    future: JobFuture  # resolves to list[Translation], in segment order
    segments: list["Segment"]
    deadline: float | None  # epoch seconds; checked before each segment takes rows
    adapter: str | None
    submitted_at: float = field(default_factory=time.monotonic)
    results: list[Translation | None] = field(default_factory=list)  # one slot per segment
    unfinished: int = 0  # segments without a result yet
    failed: bool = False


@dataclass(eq=False)
class Segment:
    job: Job
    index: int  # position in the job's texts
    src_ids: list[int]  # [src_lang] pieces </s>
    search: Search
    rows: list[int] = field(default_factory=list)  # slot rows, one per live hypothesis
    src_start: int = -1  # first source-pool token of this segment's cross-attention KV
    steps: int = 0  # decoder tokens fed so far (the next one goes to position `steps`)
    adapter_slot: int = 0  # LoRA stack slot held while running (0: base model)


class Scheduler:
    def __init__(self, table: SlotTable, adapters: AdapterRegistry | None):
        self.table = table
        self.adapters = adapters
        self.waiting: deque[Segment] = deque()
        self.running: dict[Segment, None] = {}  # insertion-ordered set: O(1) removal
        self.version = 0  # changes whenever `running` does (keys the engine's per-running-set caches)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, job: Job) -> None:
        self.waiting.extend(job.segments)

    def admit(self) -> list[Segment]:
        """Move waiting segments into free rows, in order, until one does not fit. A segment
        whose adapter is still loading is passed over (it keeps its place) so it never blocks
        the segments behind it."""
        admitted, passed_over = [], []
        while self.waiting:
            seg = self.waiting.popleft()
            if seg.job.failed or self._drop_if_cancelled_or_late(seg.job):
                continue
            adapter_slot = self._acquire_adapter(seg)
            if adapter_slot is None:
                if not seg.job.failed:
                    passed_over.append(seg)
                continue
            slot = self.table.allocate(seg.search.rows, len(seg.src_ids))
            if slot is None:
                self._release_adapter(adapter_slot)
                self.waiting.appendleft(seg)
                break
            seg.rows, seg.src_start = slot
            seg.adapter_slot = adapter_slot
            self.running[seg] = None
            self.version += 1
            admitted.append(seg)
        self.waiting.extendleft(reversed(passed_over))
        return admitted

    def _acquire_adapter(self, seg: Segment) -> int | None:
        """The segment's adapter slot (0 for none), or None while it is not resident yet."""
        name = seg.job.adapter
        if name is None or self.adapters is None:
            return 0
        slot = self.adapters.acquire(name)
        if isinstance(slot, EngineError):
            self.fail(seg.job, slot)
            return None
        return slot

    def _release_adapter(self, slot: int) -> None:
        if slot and self.adapters is not None:
            self.adapters.release(slot)

    def _drop_if_cancelled_or_late(self, job: Job) -> bool:
        if job.deadline is not None and time.time() > job.deadline:
            self.fail(job, DeadlineExceeded("the job's deadline passed before it could start"))
            return True
        if not job.future.running():
            if not job.future.set_running_or_notify_cancel():
                self.fail(job, None)  # cancelled by the submitter before it started
                return True
            job.future.started_at = time.monotonic()
        return False

    def finish(self, seg: Segment, result: Translation) -> None:
        self._release(seg)
        job = seg.job
        job.results[seg.index] = result
        job.unfinished -= 1
        if job.unfinished == 0 and not job.failed:
            job.future.set_result(list(job.results))

    def fail(self, job: Job, error: EngineError | None) -> None:
        """End a job: release its running segments, drop its waiting ones, set the error."""
        job.failed = True
        for seg in [s for s in self.running if s.job is job]:
            self._release(seg)
        if error is not None and not job.future.done():
            job.future.set_exception(error)

    def fail_all(self, error: EngineError) -> None:
        for job in {id(s.job): s.job for s in [*self.running, *self.waiting]}.values():
            self.fail(job, error)
        self.waiting.clear()

    def _release(self, seg: Segment) -> None:
        del self.running[seg]
        self.version += 1
        self.table.release(seg.rows, seg.src_start, len(seg.src_ids))
        self._release_adapter(seg.adapter_slot)
        seg.rows, seg.adapter_slot = [], 0
