"""One engine, several broker processes: the engine's API over a pipe.

One process's event loop takes a few thousand jobs a second from the broker (~0.3 ms of loop CPU a job:
aiormq's frames, parsing, replies, acks), well below what a GPU engine answers. With
NLLB_BROKER_PROCESSES = N > 1 the process that loads the engine holds no broker connection: N broker
processes (worker/processes.py) each run the whole `Service` (consume, check, reply, ack, progress,
cancellation) and reach the engine through an `EngineClient` (worker/engine_client.py), which satisfies
EngineAPI; the engine's process serves each through an `EngineServer` on its end of the pipe, all of them
read and written by the two threads of one `EngineLinks`.

The wire: lists of pickled tuples over a multiprocessing Connection (after the engine's first message,
("hello", model_name, rows_total), alone), the broker side writing through an `Outbox`, the engine side
through the `EngineLinks` writer. A texts job's kwargs may carry check_outputs=False: the broker process
makes its output warnings (worker/engine_client.py).
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
import multiprocessing.connection
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
from worker.engine_api import ServedEngine

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


def drain_wake(fd: int) -> None:
    """Read a non-blocking wake pipe empty (its bytes only say "look again")."""
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass


def portable(error: BaseException) -> BaseException:
    """An exception that pickles and keeps its meaning: engine errors as they are (the Service maps their
    codes), anything else as a RuntimeError naming it (the Service's untyped-error path, `internal`)."""
    if isinstance(error, EngineError):
        return error
    return RuntimeError(f"{type(error).__name__}: {error}")


def pickled(messages: list[tuple[Any, ...]],
            unsendable: Callable[[tuple[Any, ...], Exception], tuple[Any, ...] | None]) -> bytes | memoryview:
    """One send's payload: the messages as one pickled list, each that does not pickle replaced by `unsendable`'s
    stand-in (None: left out), so that one message's fault fails only the call it answers."""
    try:
        return ForkingPickler.dumps(messages)
    except Exception:  # noqa: BLE001 - find which ones
        sendable = []
        for message in messages:
            try:
                ForkingPickler.dumps(message)
                sendable.append(message)
            except Exception as e:  # noqa: BLE001
                log.error("a message for the other end of the engine link does not pickle", kind=message[0],
                          error=repr(e))
                stand_in = unsendable(message, e)
                if stand_in is not None:
                    sendable.append(stand_in)
        return ForkingPickler.dumps(sendable)


def send_payload(conn: Connection, payload: bytes | memoryview) -> bool:
    """Write one payload; False when the other end is gone (then both ends' readers see EOF)."""
    try:
        conn.send_bytes(payload)
        return True
    except (OSError, ValueError):
        hang_up(conn)
        return False


class Outbox:
    """A broker process's messages to the engine's process, written to the pipe by a thread of their own, a list
    a send: whoever queues one never waits on the pipe, and the other end wakes once a batch, not once a
    message."""

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
            batch = drain(self._queue)
            messages = [m for m in batch if m is not None]
            if messages and not send_payload(self._conn, pickled(messages, self._unsendable)):
                return
            if len(messages) < len(batch):
                return


def drain(q: queue.SimpleQueue) -> list:
    """The next item (waiting for it) and whatever else is queued, MAX_BATCH at most."""
    batch = [q.get()]
    while len(batch) < MAX_BATCH:
        try:
            batch.append(q.get_nowait())
        except queue.Empty:
            break
    return batch


class EngineLinks:
    """The engine's process's two threads for every broker pipe: a reader that waits on all of them at once and
    hands each batch to its pipe's EngineServer, and a writer that sends what every server queued, each pipe's
    share as one list. Every thread of that process contends for one GIL with the engine thread, so the pipes
    share two threads however many broker processes there are."""

    def __init__(self, name: str = "nllb-engine-link") -> None:
        self._servers: dict[Connection, EngineServer] = {}
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()  # a new pipe to wait on, or close: the reader's wait ends
        os.set_blocking(self._wake_r, False)
        self._closing = False
        self._outbox: queue.SimpleQueue[tuple[EngineServer, tuple[Any, ...] | None] | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name=f"{name}-read", daemon=True)
        self._writer = threading.Thread(target=self._write, name=f"{name}-write", daemon=True)
        self._reader.start()
        self._writer.start()

    def add(self, server: EngineServer) -> None:
        with self._lock:
            self._servers[server.conn] = server
        os.write(self._wake_w, b"x")

    def put(self, server: EngineServer, message: tuple[Any, ...] | None) -> None:
        """Queue a message for the server's broker process; None: close its pipe once what is before is sent."""
        self._outbox.put((server, message))

    def close(self, timeout: float = 5.0) -> None:
        """Stop both threads (pipes still open stay open: their servers' owners close them)."""
        self._closing = True
        os.write(self._wake_w, b"x")
        self._outbox.put(None)
        self._reader.join(timeout)
        self._writer.join(timeout)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _read(self) -> None:
        while not self._closing:
            with self._lock:
                conns: list[Any] = list(self._servers)
            try:
                readable = multiprocessing.connection.wait(conns + [self._wake_r])
            except (OSError, ValueError):  # a pipe closed under the wait: wait on the others
                with self._lock:
                    for conn in [c for c in self._servers if c.closed]:
                        del self._servers[conn]
                continue
            for ready in readable:
                if ready == self._wake_r:
                    drain_wake(self._wake_r)
                    continue
                server = self._servers[ready]
                if not server.receive():
                    with self._lock:
                        del self._servers[ready]

    def _write(self) -> None:
        while True:
            batch = drain(self._outbox)
            by_server: dict[EngineServer, list[tuple[Any, ...] | None]] = {}
            for item in batch:
                if item is None:
                    return
                by_server.setdefault(item[0], []).append(item[1])
            for server, messages in by_server.items():
                try:
                    server.write(messages)
                except Exception:  # noqa: BLE001 - one pipe's fault must not stop the other pipes' answers
                    log.exception("writing to a broker process's pipe failed; closing it")
                    hang_up(server.conn)  # its reader sees the end: the server closes as when the process dies


class EngineServer:
    """The engine's side of one broker process's pipe: the EngineLinks reader reads each batch and the engine
    thread submits and cancels its texts jobs (`receive`), and what the engine's threads answer goes out through
    the EngineLinks writer, so that the engine thread never waits on the pipe. When the pipe closes, the jobs it
    submitted are cancelled."""

    def __init__(self, engine: ServedEngine, conn: Connection, on_message: Callable[[tuple[Any, ...]], None],
                 links: EngineLinks) -> None:
        self.engine, self.conn, self.links = engine, conn, links
        self.on_message = on_message  # ("ready",) and ("heartbeat", ok): the supervisor's business
        self.closed = threading.Event()  # set once the pipe is closed and this end's jobs are cancelled
        self._futures: dict[int, JobFuture] = {}  # call -> the engine's future, until it is done
        self._lock = threading.Lock()
        self._gone = False  # the pipe failed or closed: nothing more is written to it
        self._ended = False  # the pipe is gone and its jobs cancelled (`_close`): submits still posted are dropped
        conn.send(("hello", engine.model_name, engine.rows_total))  # alone, before the batches
        links.add(self)

    def send(self, message: tuple[Any, ...]) -> None:
        """Queue a message for the broker process (any thread)."""
        self.links.put(self, message)

    def receive(self) -> bool:
        """Read one batch from the pipe (the EngineLinks reader, when it is readable) and act on it: its texts
        submits and cancels on the engine thread, between steps (`Engine.post`), in the order they came, where
        this thread would hold the GIL against the engine thread for each job's objects; a document's submit
        (its split and tokenizing would hold up every row's next step) and the supervisor's messages here.
        False once the pipe is gone, its jobs cancelled."""
        try:
            for_engine = []
            for message in self.conn.recv():
                if message[0] == "cancel" or message[0] == "submit" and message[2] != "document":
                    for_engine.append(message)
                elif message[0] == "submit":
                    self._submit(*message[1:])
                else:
                    self.on_message(message)
            if for_engine:
                self.engine.post(partial(self._act, for_engine))
            return True
        except (EOFError, OSError):
            pass  # the broker process closed its end or died
        except Exception:  # noqa: BLE001 - a malformed message: this pipe is unusable, the process restarted
            log.exception("broker process pipe failed; closing it")
        self._close()
        return False

    def _act(self, messages: list[tuple[Any, ...]]) -> None:
        """Texts submits and cancels, in order (on the engine thread); a malformed one ends the pipe, as in
        `receive` (its reader sees the end and closes this side)."""
        try:
            for message in messages:
                if message[0] == "submit":
                    self._submit(*message[1:])
                else:
                    with self._lock:
                        future = self._futures.get(message[1])
                    if future is not None:
                        future.cancel()
        except Exception:  # noqa: BLE001
            log.exception("broker process pipe failed; closing it")
            hang_up(self.conn)

    def write(self, messages: list[tuple[Any, ...] | None]) -> None:
        """Send queued messages (the EngineLinks writer); a None among them closes the pipe after those before."""
        closing = None in messages
        ahead = messages[:messages.index(None)] if closing else messages
        if ahead and not self._gone and not send_payload(self.conn, pickled(ahead, self._unsendable)):
            self._gone = True  # the broker process is gone: the reader sees it too, and closes
        if closing and not self.closed.is_set():
            self._gone = True
            self.conn.close()
            self.closed.set()

    def _submit(self, call: int, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any], progress: bool,
                waited: bool) -> None:
        """The job into the engine; a refusal is always answered, an acceptance only when the broker process
        waits for it (`waited`: it needs the answer count of a document). Nothing once the pipe is gone (its
        deliveries went back to the queue with the broker process's connection)."""
        if self._ended:
            return
        if progress:
            kwargs["on_segment"] = partial(self._segment, call)
        submit = self.engine.submit_document if kind == "document" else self.engine.submit
        try:
            future = submit(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a refusal (or EngineFailure): the broker process answers it
            self.send(("refused", call, portable(e)))
            return
        with self._lock:
            ended = self._ended  # `_close` ran while the engine took the job: it did not see this future
            if not ended:
                self._futures[call] = future
        if ended:
            future.cancel()
            return
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
        with its connection), then close this end once the writer is past what was queued for it."""
        with self._lock:
            self._ended = True
            futures = list(self._futures.values())
            self._futures.clear()
        for future in futures:
            future.cancel()
        if futures:
            log.warning("broker process gone: its jobs cancelled in the engine", jobs=len(futures))
        self.links.put(self, None)
