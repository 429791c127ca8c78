"""Admission into the slot table.

A job (engine/jobs.py) holds one or more segments. Each segment is admitted on its own, when the table
has its rows (`num_beams`) and source tokens; nothing is evicted mid-segment. Jobs are served first
come first served, each job's segments in order, with one exception so that a large job (a document
of thousands of sentences) does not slow down small ones: a job may hold at most `row_cap` rows while
a small job (one whose segments need `row_cap` rows or fewer in all) is in the engine. Rows beyond the
caps go to large jobs only while no small job is in the engine and none has arrived for `widen_after_s`:
a document or a large batch alone, or such jobs among themselves, fill the table; beside a stream of
interactive jobs a document keeps to its cap, so that the steps those jobs wait on stay near the width
they would have alone (a step's time grows with its rows). The wait matters because a document widened
in a short gap between interactive jobs holds its rows for its segments' whole decode: the next
interactive job would run its first steps among all of them. A large job that cannot fit in the table at
once (a document, refilling rows wave after wave) leaves a reserve of a quarter of the cap free beyond
it, so that an interactive job arriving meanwhile starts at once; one that fits takes every row, since
rows held back from it would only decode in a second wave of their own.
Whenever a segment does not fit, admission stops: the segments behind it wait too, so a wide (beam)
segment is never overtaken forever by narrow ones.
"""
from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable

from engine.errors import DeadlineExceeded, EngineError
from engine.jobs import Job, Segment
from engine.lora import AdapterRegistry
from engine.slots import SlotTable


# A stream of interactive jobs at a few a second or more leaves shorter gaps between arrivals, so a document beside
# it stays at its cap; after a burst of jobs submitted at once the document widens as soon as they are done.
WIDEN_AFTER_S = 0.2


class Scheduler:
    def __init__(self, table: SlotTable, adapters: AdapterRegistry | None, row_cap: int,
                 widen_after_s: float = WIDEN_AFTER_S, clock: Callable[[], float] = time.monotonic):
        """row_cap: the rows one job may hold while a small job is in the engine (a segment wider than it still
        runs alone); widen_after_s: how long no small job must have arrived before a large job goes beyond it."""
        self.table = table
        self.adapters = adapters
        self.row_cap = row_cap
        self.reserve = row_cap // 4  # rows a large job that does not fit at once leaves free beyond its cap
        self.widen_after_s = widen_after_s
        self.clock = clock
        self.jobs: set[Job] = set()  # jobs waiting or holding rows
        self.jobs_holding_rows = 0  # of them, those with a running segment
        self.small_jobs: set[Job] = set()  # small jobs waiting or holding rows
        self.small_arrived_at = -float("inf")  # clock() when the last small job arrived
        self.waiting: dict[Job, None] = {}  # jobs with segments waiting for rows, in arrival order
        self.running: dict[Segment, None] = {}  # insertion-ordered set: O(1) removal
        self.version = 0  # changes whenever `running` does (keys the engine's per-running-set caches)
        self.admissions = 0  # segments admitted so far (a batch made before the last one lacks it)
        # (deadline, arrival serial, job) of the jobs that came with a deadline, a heap: `expire` reads its head.
        # A job that left stays until its deadline, or until `_push_deadline` drops what left in one pass
        self._deadlines: list[tuple[float, int, Job]] = []
        self._arrivals = itertools.count()

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, job: Job) -> None:
        if job.failed:  # cancelled between its submission and its arrival here: nothing to admit
            return
        job.pending.extend(job.segments)
        job.small = sum(seg.search.rows for seg in job.segments) <= self.row_cap
        self.waiting[job] = None
        self.jobs.add(job)
        if job.small:
            self.small_jobs.add(job)
            self.small_arrived_at = self.clock()
        if job.deadline is not None:
            self._push_deadline(job)

    def _push_deadline(self, job: Job) -> None:
        heap = self._deadlines
        if len(heap) >= 2 * len(self.jobs) + 64:  # mostly jobs that finished: kept in check in amortised O(1)
            heap[:] = [entry for entry in heap if entry[2] in self.jobs]
            heapq.heapify(heap)
        heapq.heappush(heap, (job.deadline, next(self._arrivals), job))

    def expire(self) -> None:
        """Fail the jobs whose deadline passed before they finished, running or waiting (PROTOCOL: such a job is
        answered deadline_exceeded instead of being translated); their rows are free from the next step on."""
        heap, now = self._deadlines, time.time()
        while heap and heap[0][0] < now:
            job = heapq.heappop(heap)[2]
            if job in self.jobs:
                self.fail(job, DeadlineExceeded("the job's deadline passed before it finished"))

    def requeue(self, seg: Segment) -> None:
        """A segment of a running job (a retry) waits at the head: its job came first."""
        job = seg.job
        job.pending.appendleft(seg)
        if job not in self.waiting:
            self.waiting = {job: None, **self.waiting}
        self.jobs.add(job)
        if job.small:
            self.small_jobs.add(job)

    def could_admit(self) -> bool:
        """Whether `admit` would take a segment now (or drop a late job), by the same rules without their effects;
        True where unsure (an adapter still loading). False lets the engine make the next batch on the device
        (it is the running set's)."""
        blocked: Job | None = None  # the first job held back by its cap
        for job in self.waiting:
            seg = job.pending[0]
            rows = seg.search.rows
            if job.rows_held + rows <= max(self.row_cap, rows):
                return self.table.fits(rows, len(seg.src_ids))  # the capped pass stops at the first that can't
            blocked = blocked or job
        if blocked is None or not self._may_widen():
            return False
        seg = blocked.pending[0]
        return not self._keeps_reserve(blocked, seg.search.rows) and self.table.fits(seg.search.rows,
                                                                                      len(seg.src_ids))

    def admit(self) -> list[Segment]:
        """Move waiting segments into free rows: up to each job's cap, then beyond it while no small job is in the
        engine and none arrived for `widen_after_s` (see the module doc). A job whose adapter is still loading is
        passed over (it keeps its place)."""
        admitted: list[Segment] = []
        if self._admit_pass(admitted, capped=True) and self._may_widen():
            self._admit_pass(admitted, capped=False)
        return [seg for seg in admitted if seg.rows]  # a job failed in the pass (its adapter) took its rows back

    def _keeps_reserve(self, job: Job, rows: int) -> bool:
        """Whether admitting the job's next segment (of `rows` rows) beyond its cap would eat into the reserve of a
        job that cannot fit at once (its segments all take the job's num_beams rows; a retry's may differ)."""
        free = self.table.rows_total - self.table.rows_used
        return free - rows < self.reserve and len(job.pending) * rows > free

    def _may_widen(self) -> bool:
        return not self.small_jobs and self.clock() - self.small_arrived_at >= self.widen_after_s

    def _admit_pass(self, admitted: list[Segment], capped: bool) -> bool:
        """One pass over the waiting jobs in order; False when a segment did not fit the table."""
        for job in list(self.waiting):
            if job.failed or self._drop_if_late(job):
                self.waiting.pop(job, None)
                continue
            while job.pending:
                seg = job.pending[0]
                rows = seg.search.rows
                if capped and job.rows_held + rows > max(self.row_cap, rows):
                    break
                if not capped and self._keeps_reserve(job, rows):
                    return True
                adapter_slot = self._acquire_adapter(seg)
                if adapter_slot is None:
                    break
                slot = self.table.allocate(rows, len(seg.src_ids))
                if slot is None:
                    self._release_adapter(adapter_slot)
                    return False
                job.pending.popleft()
                seg.rows, seg.src_start = slot
                seg.adapter_slot = adapter_slot
                self.jobs_holding_rows += job.rows_held == 0
                job.rows_held += rows
                if job.future.started_at is None:
                    job.future.set_running_or_notify_cancel()
                    job.future.started_at = time.monotonic()
                self.running[seg] = None
                self.version += 1
                self.admissions += 1
                admitted.append(seg)
            if not job.pending:
                self.waiting.pop(job, None)
        return True

    def _acquire_adapter(self, seg: Segment) -> int | None:
        """The segment's adapter slot (0 for none), or None while it is not resident yet (or failed to load:
        the job is failed)."""
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

    def _drop_if_late(self, job: Job) -> bool:
        """Fail a job whose deadline passed during this admission (`expire` took those late before it); its
        segments admitted in this very admission are dropped from it before they reach the encoder (`admit`)."""
        if job.deadline is not None and time.time() > job.deadline:
            self.fail(job, DeadlineExceeded("the job's deadline passed before all its segments could start"))
            return True
        return False

    def release(self, *segments: Segment) -> None:
        """Running segments leave the table (finished, or their job failed); their rows and source ranges are
        freed in one call."""
        if not segments:
            return
        rows, ranges = [], []
        for seg in segments:
            del self.running[seg]
            rows += seg.rows
            ranges.append((seg.src_start, len(seg.src_ids)))
            self._release_adapter(seg.adapter_slot)
            job = seg.job
            job.rows_held -= len(seg.rows)
            if job.rows_held == 0:
                self.jobs_holding_rows -= 1
                if job not in self.waiting:  # it left the engine
                    self.small_jobs.discard(job)
                    self.jobs.discard(job)
            seg.rows, seg.adapter_slot = [], 0
        self.version += 1
        self.table.release(rows, ranges)

    def fail(self, job: Job, error: EngineError) -> int:
        """End a job: release its running segments, drop its waiting ones, set the error; the rows freed."""
        job.failed = True
        freed = job.rows_held
        self.release(*[s for s in self.running if s.job is job])
        self.waiting.pop(job, None)
        self.small_jobs.discard(job)
        self.jobs.discard(job)
        job.settle(error=error)
        return freed

    def fail_all(self, error: EngineError) -> None:
        jobs = {id(s.job): s.job for s in self.running}
        jobs.update((id(job), job) for job in self.waiting)
        for job in jobs.values():
            self.fail(job, error)
