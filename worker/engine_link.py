"""One engine, several broker processes: the engine's API over a pipe.

One process's event loop takes a few thousand jobs a second from the broker (~0.3 ms of loop CPU a job:
aiormq's frames, parsing, replies, acks), well below what a GPU engine answers. With
NLLB_BROKER_PROCESSES = N > 1 the process that loads the engine holds no broker connection: N broker
processes (worker/processes.py) each run the whole `Service` (consume, check, reply, ack, progress,
cancellation) and reach the engine through an `EngineClient`, which satisfies EngineAPI; the engine's
process serves each through an `EngineServer` on its end of the pipe.

The wire: lists of pickled tuples over a multiprocessing Connection (after the engine's first message,
("hello", model_name, rows_total), alone), each end writing through an `Outbox`.
- broker -> engine: ("submit", call, kind, args, kwargs, progress, waited), kind "texts" or "document";
  ("cancel", call); ("ready",) once consuming; ("heartbeat", ok) every HEARTBEAT_S.
- engine -> broker: ("refused", call, error), or ("accepted", call, total) when the submit is waited for;
  ("segment", call, index, Translation) as each answer position is final (progress only); ("done", call,
  started_at, result, error); ("stats", EngineStats, alive) every STATS_INTERVAL_S; ("stop", signal
  number) relayed from the engine's process.

What holds the delivery guarantees is unchanged: a broker process acks a delivery only after its reply
is confirmed. One that dies hands its unacked jobs back through the broker as its connection closes, and
its server cancels what it had submitted (their rows are freed); an engine process that dies fails every
waiting job with EngineFailure (requeued) and its broker processes stop.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import structlog

from engine import EngineStats, GenerationOptions, JobFuture, Translation
from engine.errors import EngineError, EngineFailure
from worker.engine_api import EngineAPI, OnSegment, OnWarning

log = structlog.get_logger("worker.engine_link")

STATS_INTERVAL_S = 0.5  # the engine's stats pushed to every broker process this often
STATS_STALE_S = 10.0  # no stats for this long: the engine's process is taken for unresponsive
HEARTBEAT_S = 1.0  # a broker process says whether its loop and engine are healthy this often
SUBMIT_TIMEOUT_S = 60.0  # the engine's process takes or refuses a job within this (it tokenizes and splits)
MAX_BATCH = 512  # messages written in one send at most


def hang_up(conn: Connection) -> None:
    """End the pipe for both sides now: a read blocked on it in another thread returns EOF, and so does the other
    end's (closing the descriptor alone would wake neither while that read holds it)."""
    with contextlib.suppress(OSError):
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)


def portable(error: BaseException) -> BaseException:
    """An exception that pickles and keeps its meaning: engine errors as they are (the Service maps their
    codes), anything else as a RuntimeError naming it (the Service's untyped-error path, `internal`)."""
    if isinstance(error, EngineError):
        return error
    return RuntimeError(f"{type(error).__name__}: {error}")


class Outbox:
    """One end's messages, written to the pipe by a thread of their own, a list a send: whoever queues one never
    waits on the pipe, and the other end's reader wakes once a batch, not once a message. Under load the engine
    process's threads mostly wait for the GIL, which every blocking read or write gives up, so fewer of them is
    what makes the link cheap."""

    def __init__(self, conn: Connection, name: str) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name=name, daemon=True)
        self._thread.start()

    def put(self, message: tuple[Any, ...]) -> None:
        self._queue.put(message)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop; returns once the writer is off the pipe (or after `timeout`)."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _write(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            messages = [m for m in batch if m is not None]
            try:
                if messages:
                    self._conn.send(messages)
            except (OSError, ValueError):
                hang_up(self._conn)  # the other end is gone: this end's reader sees it too
                return
            if len(messages) < len(batch):
                return


class EngineServer:
    """The engine's side of one broker process's pipe. A reader thread submits and cancels as messages arrive;
    what the engine's threads answer goes out through an Outbox, so that the engine thread never waits on the
    pipe. When the pipe closes, the jobs it submitted are cancelled."""

    def __init__(self, engine: EngineAPI, conn: Connection, on_message: Callable[[tuple[Any, ...]], None],
                 name: str) -> None:
        self.engine, self.conn = engine, conn
        self.on_message = on_message  # ("ready",) and ("heartbeat", ok): the supervisor's business
        self.closed = threading.Event()  # set once the pipe is closed and this end's jobs are cancelled
        self._futures: dict[int, JobFuture] = {}  # call -> the engine's future, until it is done
        self._lock = threading.Lock()
        conn.send(("hello", engine.model_name, engine.rows_total))  # alone, before the outbox's batches
        self._outbox = Outbox(conn, f"{name}-write")
        threading.Thread(target=self._read, name=f"{name}-read", daemon=True).start()

    def send(self, message: tuple[Any, ...]) -> None:
        """Queue a message for the broker process (any thread)."""
        self._outbox.put(message)

    def _read(self) -> None:
        try:
            while True:
                for message in self.conn.recv():
                    if message[0] == "submit":
                        self._submit(*message[1:])
                    elif message[0] == "cancel":
                        with self._lock:
                            future = self._futures.get(message[1])
                        if future is not None:
                            future.cancel()
                    else:
                        self.on_message(message)
        except (EOFError, OSError):
            pass  # the broker process closed its end or died
        except Exception:  # noqa: BLE001 - a malformed message: this pipe is unusable, the process restarted
            log.exception("broker process pipe failed; closing it")
        self._close()

    def _submit(self, call: int, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any], progress: bool,
                waited: bool) -> None:
        """The job into the engine; a refusal is always answered, an acceptance only when the broker process
        waits for it (`waited`: it needs the answer count of a document)."""
        if progress:
            kwargs["on_segment"] = partial(self._segment, call)
        submit = self.engine.submit_document if kind == "document" else self.engine.submit
        try:
            future = submit(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a refusal (or EngineFailure): the broker process answers it
            self.send(("refused", call, portable(e)))
            return
        with self._lock:
            self._futures[call] = future
        if waited:
            self.send(("accepted", call, future.total))
        future.add_done_callback(partial(self._done, call))  # after "accepted": a done future calls back here

    def _segment(self, call: int, index: int, translation: Translation) -> None:
        self.send(("segment", call, index, translation))

    def _done(self, call: int, future: JobFuture) -> None:
        with self._lock:
            self._futures.pop(call, None)
        error = future.exception()
        result = None if error is not None else future.result()
        self.send(("done", call, future.started_at, result, None if error is None else portable(error)))

    def _close(self) -> None:
        """The pipe is gone: cancel what this broker process had submitted (its deliveries went back to the queue
        with its connection), then close this end once the outbox is off it."""
        with self._lock:
            futures = list(self._futures.values())
            self._futures.clear()
        for future in futures:
            future.cancel()
        if futures:
            log.warning("broker process gone: its jobs cancelled in the engine", jobs=len(futures))
        self._outbox.close()
        self.conn.close()
        self.closed.set()


@dataclass(eq=False)
class _Call:
    """A job submitted through the pipe, until its answer arrives."""

    future: JobFuture
    job_id: str | None
    on_segment: OnSegment | None
    waited: bool  # the submitter waits for `answered`; else a refusal fails the future
    answered: threading.Event = field(default_factory=threading.Event)  # accepted or refused
    total: int = 0
    error: BaseException | None = None


class EngineClient:
    """EngineAPI in a broker process: each call goes to the engine's process over the pipe, and results,
    progress and stats come back on a receiver thread. `submit` returns at once: the engine's refusal of a texts
    job is its future's exception (the Service answers both alike), which spares a round trip a job; a document
    waits for the engine to take it, since its answer count (its sentences) is known only once it is split.
    `on_stop(signal number)` is called when the engine's process relays a stop; `on_lost()` when it is gone
    (every waiting job has then failed with EngineFailure)."""

    def __init__(self, conn: Connection) -> None:
        kind, self._model_name, self._rows_total = conn.recv()
        if kind != "hello":
            raise EngineFailure(f"the engine's process sent {kind!r} before its hello")
        self._conn = conn
        self._outbox = Outbox(conn, "nllb-engine-link-write")
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count()
        self._stats: EngineStats | None = None
        self._stats_at = time.monotonic()
        self._engine_alive = True
        self._gone = False
        self._closing = False
        self.on_stop: Callable[[int], None] | None = None
        self.on_lost: Callable[[], None] | None = None
        threading.Thread(target=self._receive, name="nllb-engine-link-read", daemon=True).start()

    # --- EngineAPI ----------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def rows_total(self) -> int:
        return self._rows_total

    def submit(self, texts: Sequence[str], src_lang: str, tgt_lang: str,
               options: GenerationOptions | None = None, adapter: str | None = None,
               deadline: float | None = None, on_warning: OnWarning = "flag",
               job_id: str | None = None, on_segment: OnSegment | None = None) -> JobFuture:
        kwargs = dict(options=options, adapter=adapter, deadline=deadline, on_warning=on_warning, job_id=job_id)
        texts = list(texts)
        return self._submit("texts", (texts, src_lang, tgt_lang), kwargs, job_id, on_segment, len(texts))

    def submit_document(self, doc: str, src_lang: str, tgt_lang: str,
                        options: GenerationOptions | None = None, adapter: str | None = None,
                        deadline: float | None = None, on_warning: OnWarning = "flag",
                        job_id: str | None = None, on_segment: OnSegment | None = None,
                        max_chars: int = 100_000) -> JobFuture:
        kwargs = dict(options=options, adapter=adapter, deadline=deadline, on_warning=on_warning, job_id=job_id,
                      max_chars=max_chars)
        return self._submit("document", (doc, src_lang, tgt_lang), kwargs, job_id, on_segment, None)

    def cancel(self, job_id: str) -> bool:
        """Cancel this process's unfinished jobs submitted with `job_id` (every broker process gets every
        cancel, and cancels its own)."""
        return any([c.future.cancel() for c in list(self._calls.values()) if c.job_id == job_id])

    def stats(self) -> EngineStats:
        if self._gone or self._stats is None:
            raise EngineFailure("no stats from the engine's process")
        return self._stats

    def is_alive(self) -> bool:
        return (not self._gone and self._engine_alive
                and time.monotonic() - self._stats_at < STATS_STALE_S)

    def close(self) -> None:
        self._closing = True
        hang_up(self._conn)

    # --- to the engine's process --------------------------------------------------------------

    def announce_ready(self) -> None:
        self._send(("ready",))

    def heartbeat(self, ok: bool) -> None:
        self._send(("heartbeat", ok))

    def _send(self, message: tuple[Any, ...]) -> None:
        """Queue a message for the engine's process; EngineFailure once it is gone (a message queued as it goes is
        dropped with the pipe, and the calls waiting on it fail in `_lost`)."""
        if self._gone:
            raise EngineFailure("the engine's process is gone")
        self._outbox.put(message)

    def _submit(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any], job_id: str | None,
                on_segment: OnSegment | None, total: int | None) -> JobFuture:
        """The job's future; `total` its answer count, or None to wait for the engine to take the job and say."""
        call_id = next(self._ids)
        call = _Call(JobFuture(), job_id, on_segment, waited=total is None)
        call.future._canceller = partial(self._cancel, call_id)
        self._calls[call_id] = call
        try:
            self._send(("submit", call_id, kind, args, kwargs, on_segment is not None, call.waited))
        except EngineFailure:
            self._calls.pop(call_id, None)
            raise
        if total is not None:
            call.future.total = total
            return call.future
        if not call.answered.wait(SUBMIT_TIMEOUT_S):
            self._cancel(call_id)
            self._calls.pop(call_id, None)
            raise EngineFailure(f"the engine's process did not take the job within {SUBMIT_TIMEOUT_S:.0f} s")
        if call.error is not None:
            self._calls.pop(call_id, None)
            raise call.error
        call.future.total = call.total
        return call.future

    def _cancel(self, call_id: int) -> bool:
        call = self._calls.get(call_id)
        if call is None or call.future.done():
            return False
        try:
            self._send(("cancel", call_id))
        except EngineFailure:
            return False
        return True

    # --- from the engine's process ------------------------------------------------------------

    def _receive(self) -> None:
        try:
            while True:
                for message in self._conn.recv():
                    self._dispatch(message)
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 - a message this side cannot read: the link is unusable
            log.exception("engine link failed")
        self._gone = True
        self._outbox.close()
        self._conn.close()
        self._lost()

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "stats":
            self._stats, self._engine_alive = message[1], message[2]
            self._stats_at = time.monotonic()
        elif kind == "done":
            _, call_id, started_at, result, error = message
            call = self._calls.pop(call_id, None)
            if call is not None:
                call.future.started_at = started_at
                if error is not None:
                    call.future.set_exception(error)
                else:
                    call.future.set_result(result)
        elif kind in ("accepted", "refused"):
            call = self._calls.get(message[1])
            if call is not None:
                if kind == "accepted":
                    call.total = message[2]
                else:
                    call.error = message[2]
                    if not call.waited:
                        self._calls.pop(message[1], None)
                        call.future.set_exception(call.error)
                call.answered.set()
        elif kind == "segment":
            call = self._calls.get(message[1])
            if call is not None and call.on_segment is not None:
                call.on_segment(message[2], message[3])
        elif kind == "stop" and self.on_stop is not None:
            self.on_stop(message[1])

    def _lost(self) -> None:
        """The pipe closed: by `close`, or because the engine's process is gone."""
        if self._closing:
            return
        calls = list(self._calls.values())
        self._calls.clear()
        log.error("the engine's process is gone; failing the jobs waiting on it", jobs=len(calls))
        for call in calls:
            call.error = EngineFailure("the engine's process is gone")
            call.answered.set()
            if not call.future.done():
                call.future.set_exception(EngineFailure("the engine's process is gone"))
        if self.on_lost is not None:
            self.on_lost()
