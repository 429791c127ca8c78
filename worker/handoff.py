"""The event loop's hand-offs to other threads, gathered so that one wake-up serves many jobs.

A thread hop costs the loop thread more than most of a small job's own work: a work item for the
executor, a thread woken up, and `call_soon_threadsafe` back (an asyncio future chained both ways
for each). Under load many jobs make the same hop in the same loop iteration (a socket read brings
a batch of deliveries; one engine step finishes many jobs), so they share it:

- `Offload.call(fn)`: the calls made while the loop runs one iteration run one after another on
  the offload thread (one queue put, cheaper than an executor's work item), and come back in ONE
  callback on the loop. Work that may take long (a large body, a document to split) goes on a
  thread of its own instead (`heavy`), so it never holds up the small jobs of a batch.
- `EngineWaits.wait(future)`: the engine thread's finished job futures reach the loop in batches,
  one `call_soon_threadsafe` for all that finished before the loop woke up. `abort_all` ends every
  wait at once (the drain's time ran out).
"""
from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

#: what one offloaded call gave: (the loop's future, its result, or the exception it raised)
_Outcome = tuple["asyncio.Future[Any]", Any, BaseException | None]


_Batch = list[tuple[contextvars.Context, Callable[[], Any], "asyncio.Future[Any]"]]


class Offload:
    """Calls for the offload thread, run in batches (see the module doc). The thread starts with the
    first batch and ends at `close()`."""

    def __init__(self) -> None:
        self._pending: _Batch = []
        self._batches: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, _Batch] | None] | None = None

    def call(self, fn: Callable[[], T], heavy: bool = False) -> asyncio.Future[T]:
        """fn() on a worker thread, in the caller's context (its log bindings); an awaitable of
        its result. `heavy`: on a thread of its own, not in the batch."""
        loop = asyncio.get_running_loop()
        if heavy:
            return asyncio.ensure_future(asyncio.to_thread(fn))
        future: asyncio.Future[T] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush, loop)
        self._pending.append((contextvars.copy_context(), fn, future))
        return future

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self._pending = self._pending, []
        if self._batches is None:
            self._batches = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._batches,), name="nllb-offload", daemon=True).start()
        self._batches.put((loop, batch))

    def close(self) -> None:
        """End the offload thread once the batches queued before are done."""
        if self._batches is not None:
            self._batches.put(None)
            self._batches = None


def _serve(batches: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, _Batch] | None]) -> None:
    while (item := batches.get()) is not None:
        _run_batch(*item)


def _run_batch(loop: asyncio.AbstractEventLoop, batch: _Batch) -> None:
    """On the offload thread: every call of the batch, then one hand-back to the loop."""
    outcomes: list[_Outcome] = []
    for context, fn, future in batch:
        try:
            outcomes.append((future, context.run(fn), None))
        except BaseException as e:  # noqa: BLE001 - the caller's await raises it
            outcomes.append((future, None, e))
    loop.call_soon_threadsafe(_resolve, outcomes)


def _resolve(outcomes: list[_Outcome]) -> None:
    for future, result, error in outcomes:
        if future.done():  # its task was cancelled meanwhile
            continue
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


class Aborted(Exception):
    """The wait ended by `EngineWaits.abort_all`, not by the engine."""


class EngineWaits:
    """The engine's job futures awaited on the loop, their results delivered in batches."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._finished: deque[tuple[Future[Any], asyncio.Future[Any]]] = deque()
        self._wakeup_pending = False  # a _deliver is scheduled and has not started yet
        self._waiting: set[asyncio.Future[Any]] = set()
        self._aborted = False

    async def wait(self, future: Future[T]) -> T:
        """The engine future's result (its exception raised); Aborted after `abort_all`."""
        if self._aborted:
            raise Aborted()
        self._loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Any] = self._loop.create_future()
        self._waiting.add(waiter)
        try:
            future.add_done_callback(lambda done: self._on_done(done, waiter))
            await waiter
        finally:
            self._waiting.discard(waiter)
        return future.result()

    def _on_done(self, future: Future[Any], waiter: asyncio.Future[Any]) -> None:
        """Any thread (the engine's): queue the finished future; wake the loop unless a wake-up is
        already on its way. The flag is cleared before the queue is emptied, so a future queued
        after a wake-up started is either taken by it or wakes the loop again."""
        assert self._loop is not None
        self._finished.append((future, waiter))
        if not self._wakeup_pending:
            self._wakeup_pending = True
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        self._wakeup_pending = False
        while self._finished:
            _, waiter = self._finished.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def abort_all(self) -> None:
        """End every wait now and every later one at once, with Aborted."""
        self._aborted = True
        for waiter in self._waiting:
            if not waiter.done():
                waiter.set_exception(Aborted())
