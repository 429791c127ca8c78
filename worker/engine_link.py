"""One engine, several broker processes: the engine's API over a pipe.

One process's event loop takes a few thousand jobs a second from the broker (~0.3 ms of loop CPU a job:
aiormq's frames, parsing, replies, acks), well below what a GPU engine answers. With
NLLB_BROKER_PROCESSES = N > 1 the process that loads the engine holds no broker connection: N broker
processes (worker/processes.py) each run the whole `Service` (consume, check, reply, ack, progress,
cancellation) and reach the engine through an `EngineClient` (worker/engine_client.py), which satisfies
EngineAPI; the engine's process serves each through an `EngineServer` on its end of the pipe.

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
import os
import queue
import socket
import threading
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import structlog

from engine import JobFuture, Translation
from engine.errors import EngineError
from worker.engine_api import EngineAPI

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

    def __init__(self, conn: Connection, name: str,
                 unsendable: Callable[[tuple[Any, ...], Exception], tuple[Any, ...] | None]) -> None:
        self._conn = conn
        self._unsendable = unsendable  # a message that does not pickle -> what to send instead (None: nothing)
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
            if messages:
                try:
                    payload = ForkingPickler.dumps(messages)
                except Exception as e:  # noqa: BLE001 - one message's fault: the others still go
                    payload = self._each_that_pickles(messages, e)
                try:
                    self._conn.send_bytes(payload)
                except (OSError, ValueError):
                    hang_up(self._conn)  # the other end is gone: this end's reader sees it too
                    return
            if len(messages) < len(batch):
                return

    def _each_that_pickles(self, messages: list[tuple[Any, ...]], error: Exception) -> memoryview:
        """The batch with each message that does not pickle replaced by the owner's stand-in (the call it answers
        fails instead of waiting for ever)."""
        sendable = []
        for message in messages:
            try:
                ForkingPickler.dumps(message)
                sendable.append(message)
            except Exception as e:  # noqa: BLE001
                log.error("a message for the other end of the engine link does not pickle", kind=message[0],
                          error=repr(e))
                stand_in = self._unsendable(message, e)
                if stand_in is not None:
                    sendable.append(stand_in)
        return ForkingPickler.dumps(sendable)


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
        self._outbox = Outbox(conn, f"{name}-write", self._unsendable)
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

    @staticmethod
    def _unsendable(message: tuple[Any, ...], error: Exception) -> tuple[Any, ...] | None:
        """An answer that does not pickle becomes a failure of its call; progress and stats are left out."""
        failure = RuntimeError(f"the engine's answer could not be sent to the broker process: {error!r}")
        if message[0] == "done":
            return message[:3] + (None, failure)
        if message[0] == "refused":
            return message[:2] + (failure,)
        return None

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
