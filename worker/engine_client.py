"""The broker processes' side of the engine link (worker/engine_link.py has the wire and the engine's side): an
EngineAPI whose calls go to the engine's process over the pipe.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import InvalidStateError
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import structlog

from engine import EngineStats, GenerationOptions, JobFuture, Translation
from engine.errors import EngineFailure
from engine.text import langid
from engine.text.quality import translation_warnings
from worker.engine_api import OnSegment, OnWarning
from worker.engine_link import STATS_STALE_S, SUBMIT_TIMEOUT_S, Outbox, hang_up

log = structlog.get_logger("worker.engine_client")


def fail(future: JobFuture, error: BaseException) -> None:
    """Fail the future unless it is done already (two threads may each have a reason to fail it)."""
    with contextlib.suppress(InvalidStateError):
        future.set_exception(error)


@dataclass(eq=False)
class _Call:
    """A job submitted through the pipe, until its answer arrives."""

    future: JobFuture
    job_id: str | None
    on_segment: OnSegment | None
    waited: bool  # the submitter waits for `answered`; else a refusal fails the future
    check: tuple[list[str], str, str] | None = None  # (texts, src_lang, tgt_lang) whose warnings are made here
    answered: threading.Event = field(default_factory=threading.Event)  # accepted or refused
    total: int = 0
    error: BaseException | None = None
    warnings: dict[int, list[str]] = field(default_factory=dict)  # per text, once made (progress, then result)


class EngineClient:
    """EngineAPI in a broker process: each call goes to the engine's process over the pipe, and results,
    progress and stats come back on a receiver thread. `submit` returns at once: the engine's refusal of a texts
    job is its future's exception (the Service answers both alike), which spares a round trip a job; a document
    waits for the engine to take it, since its answer count (its sentences) is known only once it is split.
    `listen(on_stop, on_lost)`: on_stop(signal number) when the engine's process relays a stop, on_lost() when it
    is gone (every waiting job has then failed with EngineFailure).
    `check_outputs`: a texts job's output warnings are made here, on the receiver thread, from each text and its
    translation, not on the engine's thread: the engine's process is the one all broker processes share, and
    the checks with the language identifier behind off_target take ~60 us a ~100-character text (as the engine
    does it: a job with on_warning "retry" is still checked in the engine, which decides on the retry from them)."""

    def __init__(self, conn: Connection, check_outputs: bool = False) -> None:
        kind, self._model_name, self._rows_total = conn.recv()
        if kind != "hello":
            raise EngineFailure(f"the engine's process sent {kind!r} before its hello")
        self._check_outputs = check_outputs
        if check_outputs:
            langid.library_labels()  # the identifier loaded now, not at the first answer
        self._conn = conn
        self._outbox = Outbox(conn, "nllb-engine-link-write", self._unsendable)
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count()
        self._stats: EngineStats | None = None
        self._stats_at = time.monotonic()
        self._engine_alive = True
        self._gone = False
        self._closing = False
        self._events = threading.Lock()  # the handlers below against the receiver thread's stop and loss
        self._on_stop: Callable[[int], None] | None = None
        self._on_lost: Callable[[], None] | None = None
        self._stop_signal: int | None = None  # the last stop relayed, once one came
        self._lost_seen = False
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
        texts = texts if isinstance(texts, str) else list(texts)  # a str is the engine's to refuse, not to split
        check = None
        if self._check_outputs and on_warning != "retry" and not isinstance(texts, str):
            kwargs["check_outputs"] = False
            check = (texts, src_lang, tgt_lang)
        return self._submit("texts", (texts, src_lang, tgt_lang), kwargs, job_id, on_segment, len(texts), check)

    def submit_document(self, doc: str, src_lang: str, tgt_lang: str,
                        options: GenerationOptions | None = None, adapter: str | None = None,
                        deadline: float | None = None, on_warning: OnWarning = "flag",
                        job_id: str | None = None, on_segment: OnSegment | None = None,
                        max_chars: int = 100_000) -> JobFuture:
        kwargs = dict(options=options, adapter=adapter, deadline=deadline, on_warning=on_warning, job_id=job_id,
                      max_chars=max_chars)
        return self._submit("document", (doc, src_lang, tgt_lang), kwargs, job_id, on_segment, None, None)

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
                on_segment: OnSegment | None, total: int | None, check: tuple[list[str], str, str] | None
                ) -> JobFuture:
        """The job's future; `total` its answer count, or None to wait for the engine to take the job and say."""
        call_id = next(self._ids)
        call = _Call(JobFuture(), job_id, on_segment, waited=total is None, check=check)
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

    def _unsendable(self, message: tuple[Any, ...], error: Exception) -> None:
        """A submit that does not pickle fails its call here (nothing is sent); other messages are left out."""
        if message[0] == "submit":
            self._refused(message[1], RuntimeError(f"the job could not be sent to the engine's process: {error!r}"))

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
                if error is None and call.check is not None:
                    error = self._checked(call, enumerate(result))
                if error is not None:
                    fail(call.future, error)
                else:
                    call.future.set_result(result)
        elif kind == "accepted":
            call = self._calls.get(message[1])
            if call is not None:
                call.total = message[2]
                call.answered.set()
        elif kind == "refused":
            self._refused(message[1], message[2])
        elif kind == "segment":
            call = self._calls.get(message[1])
            if call is not None and call.on_segment is not None:
                if call.check is not None and self._checked(call, [(message[2], message[3])]) is not None:
                    return  # the job fails with its result
                try:
                    call.on_segment(message[2], message[3])
                except Exception:  # noqa: BLE001 - the submitter's bug must not stop the link (as in the engine)
                    log.exception("on_segment callback failed", segment=message[2], job_id=call.job_id)
        elif kind == "stop":
            with self._events:
                self._stop_signal, on_stop = message[1], self._on_stop
            if on_stop is not None:
                on_stop(message[1])

    def listen(self, on_stop: Callable[[int], None], on_lost: Callable[[], None]) -> None:
        """Call on_stop(signal number) at each stop the engine's process relays and on_lost() once it is gone; a
        stop or a loss that came before (this broker process still starting while another failed at once and the
        worker stops) is delivered now: dropped, it left this process consuming until the stop's kill deadline."""
        with self._events:
            self._on_stop, self._on_lost = on_stop, on_lost
            stop_signal, lost = self._stop_signal, self._lost_seen
        if stop_signal is not None:
            on_stop(stop_signal)
        if lost:
            on_lost()

    @staticmethod
    def _checked(call: _Call, answers: Iterable[tuple[int, Translation]]) -> BaseException | None:
        """Give each (text index, translation) its output warnings (each text's made once); what fails here fails
        the job, as a failure finishing it in the engine would (returned)."""
        texts, src_lang, tgt_lang = call.check
        try:
            for i, t in answers:
                if i not in call.warnings:
                    call.warnings[i] = translation_warnings(texts[i], t.detected_lang or src_lang, tgt_lang, t)
                t.warnings = list(call.warnings[i])
        except Exception as e:  # noqa: BLE001 - a bug on one job's text path; the link serves on
            log.exception("checking a translation failed; failing its job", job_id=call.job_id)
            return RuntimeError(f"checking the translation failed: {e!r}")
        return None

    def _refused(self, call_id: int, error: BaseException) -> None:
        """The job will not run: its waiting submitter raises `error`, or its future does."""
        call = self._calls.get(call_id)
        if call is None:
            return
        call.error = error
        if not call.waited:
            self._calls.pop(call_id, None)
            fail(call.future, error)
        call.answered.set()

    def _lost(self) -> None:
        """The pipe closed: by `close`, or because the engine's process is gone. Either way every call still
        waiting fails now: a submit waiting for the engine to take its job (on a thread of the Service's) would
        otherwise hold that thread, and the process's exit, for SUBMIT_TIMEOUT_S."""
        calls = list(self._calls.values())
        self._calls.clear()
        reason = "the link to the engine's process was closed" if self._closing else "the engine's process is gone"
        for call in calls:
            call.error = EngineFailure(reason)
            call.answered.set()
            fail(call.future, call.error)
        if self._closing:
            return
        log.error("the engine's process is gone; failed the jobs waiting on it", jobs=len(calls))
        with self._events:
            self._lost_seen, on_lost = True, self._on_lost
        if on_lost is not None:
            on_lost()
