"""Cancellation (docs/protocol.md "Cancellation"): control messages from the `nllb.control` fanout
exchange, the jobs this worker holds, and the ids cancelled lately.

Every worker gets every cancel. One that holds the job (its engine future: waiting for rows or
decoding) cancels the future; the engine frees the job's rows at the next step and the future
raises `Cancelled`, which the job's own task answers `cancelled` and acks. Every worker also
remembers the id for `cancel_memory_s`, so a job that arrives after its cancel (or whose cancel
arrives while it is being parsed or split, before the engine has it) is answered `cancelled`
without being translated. An unknown or finished id changes nothing but that memory.

All of it runs on the event loop; the engine's futures are only asked to cancel (thread-safe).
"""
from __future__ import annotations

import contextlib
import json
import time
from collections import OrderedDict
from collections.abc import Iterator

import structlog
from pydantic import ValidationError

from engine import JobFuture
from worker.messages import CancelRequest, clip, find_unencodable

log = structlog.get_logger("worker.control")

MAX_REMEMBERED = 10_000  # ids held in memory at most (the oldest are forgotten first)
# A cancel is {"v": 1, "cancel": id} with an id of at most 512 characters. The longest any producer may send:
# 512 astral characters escaped as surrogate pairs ("\ud83d\ude00", 12 bytes each) = 6,166 bytes.
MAX_CONTROL_BYTES = 8192


class CancelMemory:
    """Job ids cancelled in the last `memory_s` seconds, at most `max_ids` of them."""

    def __init__(self, memory_s: float, max_ids: int = MAX_REMEMBERED) -> None:
        self.memory_s, self.max_ids = memory_s, max_ids
        self._until: OrderedDict[str, float] = OrderedDict()  # id -> forget at (monotonic), oldest first

    def add(self, job_id: str) -> None:
        self._until.pop(job_id, None)
        self._until[job_id] = time.monotonic() + self.memory_s
        self._expire()

    def __contains__(self, job_id: object) -> bool:
        self._expire()
        return job_id in self._until

    def __len__(self) -> int:
        self._expire()
        return len(self._until)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._until and (len(self._until) > self.max_ids or next(iter(self._until.values())) <= now):
            self._until.popitem(last=False)


class Cancellations:
    """The engine futures of the jobs this worker holds, by job id, and the cancel memory."""

    def __init__(self, memory_s: float) -> None:
        self.memory = CancelMemory(memory_s)
        self._held: dict[str, set[JobFuture]] = {}

    def cancelled(self, job_id: str | None) -> bool:
        """A cancel for this id arrived within the memory window."""
        return job_id is not None and job_id in self.memory

    @contextlib.contextmanager
    def holding(self, job_id: str | None, future: JobFuture) -> Iterator[None]:
        """While the job's future is awaited, a cancel for its id cancels it; one that came while
        the job was on its way to the engine cancels it at once."""
        if job_id is None:
            yield
            return
        self._held.setdefault(job_id, set()).add(future)
        if job_id in self.memory:
            future.cancel()
        try:
            yield
        finally:
            futures = self._held.get(job_id, set())
            futures.discard(future)
            if not futures:
                self._held.pop(job_id, None)

    def on_control(self, body: bytes) -> None:
        """One control message: a cancel is remembered and cancels the jobs held under its id;
        anything else is logged and dropped."""
        try:
            if len(body) > MAX_CONTROL_BYTES:  # parsed on the event loop: a huge body must not stall it
                raise ValueError(f"{len(body)} bytes; a cancel takes at most {MAX_CONTROL_BYTES}")
            data = json.loads(body)
            if isinstance(data, dict) and find_unencodable(data) is not None:
                raise ValueError("a lone surrogate: not Unicode")
            request = CancelRequest.model_validate(data)
        except (ValueError, ValidationError, RecursionError) as e:
            log.warning("control message dropped: not a cancel", bytes=len(body),
                        error=clip(str(e).replace("\n", " ")))
            return
        job_id = request.cancel
        self.memory.add(job_id)
        futures = list(self._held.get(job_id, ()))
        taken = [f for f in futures if f.cancel()]
        log.info("cancel received", job_id=clip(job_id), held=len(futures), cancelled=len(taken))
