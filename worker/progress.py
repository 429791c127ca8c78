"""Progress of one job (option "progress": true): `partial` messages to its reply_to while it runs.

The engine calls `on_segment(index, translation)` on its own thread as each segment is final; the
call only hands the segment to the event loop (`loop.call_soon_threadsafe`). On the loop, finished
segments wait in `pending` and go out together, at most one message every `interval_s`, each with
the segments finished since the previous one. A partial is published on the same confirming
channel as the final reply (so the broker keeps their order) but nobody waits for its
confirmation: the job's ack waits for the final reply only. `close()` drops what was not sent yet
(the final reply carries it) and lets a partial already on its way finish first, so the final
reply always comes last.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from engine import Translation
from worker.messages import PartialReply, PartialSegment, dump_reply

log = structlog.get_logger("worker.progress")

INTERVAL_S = 0.5
CLOSE_WAIT_S = 1.0  # how long close() lets a partial already being published finish

Send = Callable[[bytes], Awaitable[object]]


class Progress:
    """The partial messages of one job. `total`: the segments it is answered in (texts, or the
    document's sentences), known once the engine took the job (`start`); segments that finish
    before it is known wait for it."""

    def __init__(self, job_id: str | None, send: Send, interval_s: float = INTERVAL_S) -> None:
        self.loop = asyncio.get_running_loop()
        self.job_id, self.send, self.interval_s = job_id, send, interval_s
        self.total: int | None = None
        self.done = 0
        self._pending: list[PartialSegment] = []
        self._last_sent = -float("inf")  # loop time of the last partial
        self._timer: asyncio.TimerHandle | None = None
        self._sending: asyncio.Task[None] | None = None
        self._closed = False

    def on_segment(self, index: int, translation: Translation) -> None:
        """The engine's callback (engine thread): hand the finished segment to the loop."""
        self.loop.call_soon_threadsafe(self._add, PartialSegment(index=index, text=translation.text))

    def _add(self, segment: PartialSegment) -> None:
        if self._closed:
            return
        self.done += 1
        self._pending.append(segment)
        self._schedule()

    def start(self, total: int) -> None:
        """The engine took the job: its segment count, and any partial that waited for it."""
        self.total = total
        self._schedule()

    def _schedule(self) -> None:
        if (self._timer is None and self._sending is None and self._pending and not self._closed
                and self.total is not None):
            delay = max(0.0, self._last_sent + self.interval_s - self.loop.time())
            self._timer = self.loop.call_later(delay, self._flush)

    def _flush(self) -> None:
        self._timer = None
        if self._closed or not self._pending:
            return
        batch, self._pending = self._pending, []
        message = PartialReply(id=self.job_id, done=self.done, total=self.total, segments=batch)
        self._last_sent = self.loop.time()
        self._sending = self.loop.create_task(self._publish(dump_reply(message)))
        self._sending.add_done_callback(self._sent)

    async def _publish(self, body: bytes) -> None:
        try:
            await self.send(body)
        except Exception as e:  # noqa: BLE001 - a lost partial is no failure of the job
            log.info("partial message not published", job_id=self.job_id, error=repr(e))

    def _sent(self, _: asyncio.Task[None]) -> None:
        self._sending = None
        self._schedule()

    async def close(self) -> None:
        """No partial after this returns: what is pending is dropped (the final reply has it);
        one being published gets CLOSE_WAIT_S to finish, then it is cancelled."""
        self._closed = True
        self._pending = []
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        sending = self._sending
        if sending is not None:
            await asyncio.wait({sending}, timeout=CLOSE_WAIT_S)
            if not sending.done():
                sending.cancel()
                await asyncio.wait({sending})
