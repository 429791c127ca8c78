"""message → job → engine → reply → ack. Every ack/nack/reject decision is in `ACTIONS`/`decide`.

The path of one delivery (one asyncio task each):

1. parse the body (strict pydantic models of PROTOCOL.md);
2. validate what the worker owns (reply_to, deadline on receipt, languages present, segment limit,
   options) and submit to the engine (which raises the input errors synchronously and checks the
   deadline again before the job takes rows);
3. await the engine's future without blocking the loop (`asyncio.wrap_future`);
4. publish the reply (confirmed, mandatory) on the current channel — after a reconnection too;
5. settle the delivery per the decision table below.

| outcome            | when                                                         | action  |
|--------------------|--------------------------------------------------------------|---------|
| ok                 | translated; reply confirmed                                  | ack     |
| error              | deterministic error (bad JSON/schema/options, unknown        | ack     |
|                    | language/adapter, too long, deadline, overloaded, internal); |         |
|                    | error reply confirmed                                        |         |
| dead_letter        | unanswerable: no reply_to (parseable or not)                 | reject → DLQ |
| requeue            | engine failure, shutdown, reply not confirmed before shutdown| nack, requeue |
| reply_returned     | reply unroutable (reply queue gone): nobody is listening     | ack     |

A delivery whose channel died meanwhile cannot be settled (stale tag; the broker requeued it):
it is counted as `stale`, never acked twice, and answered again when redelivered.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import enum
import time
from dataclasses import dataclass
from typing import Any

import structlog
from aio_pika.abc import AbstractIncomingMessage

from engine.errors import EngineError, EngineFailure, InvalidRequest
from engine.options import GenerationOptions
from worker.amqp import Broker, Published, Settle, settle
from worker.messages import (
    BadJob,
    ErrorReply,
    HypothesisOut,
    JobRequest,
    OkReply,
    Timings,
    TranslationOut,
    Usage,
    dump_reply,
    error_reply,
    parse_job,
)
from worker.metrics import Metrics
from worker.settings import Settings

log = structlog.get_logger("worker.service")


class Outcome(enum.Enum):
    OK = "ok"
    ERROR = "error"
    DEAD_LETTER = "dead_letter"
    REQUEUE = "requeue"
    REPLY_RETURNED = "reply_returned"


#: THE decision table: outcome of a delivery → what the broker is told.
ACTIONS: dict[Outcome, str] = {
    Outcome.OK: "ack",
    Outcome.ERROR: "ack",
    Outcome.DEAD_LETTER: "reject",
    Outcome.REQUEUE: "requeue",
    Outcome.REPLY_RETURNED: "ack",
}


def decide(outcome: Outcome) -> str:
    return ACTIONS[outcome]


@dataclass
class Result:
    outcome: Outcome
    code: str = ""          # error code for ERROR, reason for the others
    reply: OkReply | ErrorReply | None = None


class _Requeue(Exception):
    """Give the job back to the queue. `reason` is a short label (metrics), `detail` is logged."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


def build_options(req: JobRequest) -> GenerationOptions | None:
    fields = req.options.generation_fields()
    return GenerationOptions(**fields) if fields else None


def ok_reply(req: JobRequest, job_id: str | None, src: str, tgt: str, model: str,
             results: list[Any], queued_ms: float, compute_ms: float) -> OkReply:
    want_scores, want_tokens = req.options.return_scores, req.options.return_tokens
    out = []
    for t in results:
        hyps = None
        if len(t.hypotheses or []) > 1:
            hyps = [HypothesisOut(text=h.text, score=float(h.score) if want_scores else None,
                                  tokens=list(h.tokens) if want_tokens else None)
                    for h in t.hypotheses]
        out.append(TranslationOut(text=t.text, score=float(t.score) if want_scores else None,
                                  tokens=list(t.tokens) if want_tokens else None, hypotheses=hyps))
    usage = Usage(src_tokens=sum(int(t.src_tokens) for t in results),
                  tgt_tokens=sum(len(t.tokens) for t in results))
    return OkReply(id=job_id, translations=out, src_lang=src, tgt_lang=tgt, adapter=req.adapter,
                   model=model, usage=usage,
                   timings_ms=Timings(queued=round(queued_ms, 3), compute=round(compute_ms, 3)))


class Service:
    """Consumes the jobs queue into the engine. `run()` until `stop()`; then drains and exits."""

    def __init__(self, settings: Settings, engine: Any, metrics: Metrics | None = None,
                 name: str = "nllb-worker", owns_engine: bool = True) -> None:
        self.settings = settings
        self.owns_engine = owns_engine  # close it on shutdown
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.broker = Broker(settings, self.metrics, name=name)
        self._tasks: set[asyncio.Task] = set()
        self._stopping = False
        self._stop_event: asyncio.Event | None = None
        self._abort: asyncio.Future | None = None
        self._stats_task: asyncio.Task | None = None
        self._engine_closed = False
        self._last_progress = (time.monotonic(), -1)
        self.prefetch = settings.prefetch or max(1, int(engine.rows_total))
        self.started = asyncio.Event()

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        self._abort = loop.create_future()
        self.metrics.rows_total.set(self.engine.rows_total)
        await self.broker.connect(self.prefetch)
        await self.broker.consume(self._on_message)
        self._stats_task = loop.create_task(self._poll_stats(), name="engine-stats")
        self.started.set()

    def stop(self) -> None:
        """Ask for a graceful stop (signal handlers call this)."""
        if self._stop_event is not None:
            self._stop_event.set()

    async def run(self) -> None:
        """start, serve until stop(), then shutdown."""
        await self.start()
        assert self._stop_event is not None
        await self._stop_event.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop consuming, drain in-flight jobs within drain_timeout_s, requeue the rest, close."""
        self._stopping = True
        log.info("stopping: consumer cancelled, draining", in_flight=len(self._tasks),
                 drain_timeout_s=self.settings.drain_timeout_s)
        await self.broker.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=self.settings.drain_timeout_s)
            if pending:
                log.warning("drain timeout: requeueing unfinished jobs", jobs=len(pending))
                assert self._abort is not None
                if not self._abort.done():
                    self._abort.set_result(None)
                await asyncio.wait(pending, timeout=15)
        if self._stats_task:
            self._stats_task.cancel()
        await self.close_engine()
        await self.broker.close()
        log.info("stopped", jobs_ok=self.metrics.count("ok"))

    async def close_engine(self) -> None:
        if not self._engine_closed:
            self._engine_closed = True
            if self.owns_engine:
                try:
                    await asyncio.to_thread(self.engine.close)
                except Exception:
                    log.exception("engine.close failed")

    # --- health -------------------------------------------------------------------------------

    def engine_ok(self) -> bool:
        """Engine up: not closed, its thread alive, and making progress when busy."""
        if self._engine_closed or not self.engine.is_alive():
            return False
        try:
            s = self.engine.stats()
        except Exception:  # noqa: BLE001
            return False
        now = time.monotonic()
        t, tokens = self._last_progress
        if s.tokens_generated != tokens or s.jobs_running == 0:
            self._last_progress = (now, s.tokens_generated)
            return True
        return now - t < 120.0  # busy and no token for two minutes: stuck

    def ready(self) -> bool:
        return not self._stopping and self.broker.consuming() and self.engine_ok()

    async def _poll_stats(self) -> None:
        while True:
            try:
                s = self.engine.stats()
                self.metrics.rows_used.set(s.rows_used)
                self.metrics.rows_total.set(s.rows_total)
                self.metrics.jobs_waiting.set(s.jobs_waiting)
                self.metrics.engine_tokens.set(s.tokens_generated)
            except Exception as e:  # noqa: BLE001
                log.warning("engine stats failed", error=repr(e))
            await asyncio.sleep(1.0)

    # --- one delivery -------------------------------------------------------------------------

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        # a fresh context per job, so contextvars bound for it never leak into another
        loop = asyncio.get_running_loop()
        task = contextvars.Context().run(loop.create_task, self._handle(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        t0 = time.monotonic()
        self.metrics.in_flight.inc()
        structlog.contextvars.bind_contextvars(job_id=message.message_id,
                                               delivery=message.delivery_tag,
                                               redelivered=message.redelivered)
        try:
            if self._stopping:
                result = Result(Outcome.REQUEUE, "shutdown")
            else:
                try:
                    result = await self._process(message)
                except _Requeue as r:
                    if r.detail:
                        log.warning("requeueing the job", reason=r.reason, detail=r.detail)
                    result = Result(Outcome.REQUEUE, r.reason)
                except Exception:  # a worker bug: requeue; the delivery limit stops a loop
                    log.exception("job handling failed unexpectedly; requeueing")
                    result = Result(Outcome.REQUEUE, "worker_error")
            action = decide(result.outcome)
            settled = await settle(message, action)
            if settled is Settle.STALE:
                self.metrics.stale_acks.inc()
                self.metrics.job_done("stale", result.code)
                log.warning("delivery stale: its channel closed, the broker requeued it; "
                            "it will be answered again", wanted=action,
                            outcome=result.outcome.value)
            elif settled is Settle.ALREADY:
                log.error("delivery already settled; not settling twice", wanted=action)
            else:
                self.metrics.job_done(result.outcome.value, result.code)
            log.info("job settled", outcome=result.outcome.value, code=result.code or None,
                     action=action, settle=settled.value,
                     total_ms=round((time.monotonic() - t0) * 1e3, 3))
        finally:
            self.metrics.in_flight.dec()

    async def _process(self, message: AbstractIncomingMessage) -> Result:
        t_recv = time.time()
        reply_to = message.reply_to or None
        if message.timestamp is not None:
            self.metrics.queue_wait.observe(max(0.0, t_recv - message.timestamp.timestamp()))
        try:
            req = parse_job(message.body)
        except BadJob as e:
            if reply_to is None:
                log.warning("unparseable job without reply_to: dead-lettered", error=str(e),
                            bytes=len(message.body))
                return Result(Outcome.DEAD_LETTER, "unanswerable")
            job_id = e.job_id or message.message_id
            structlog.contextvars.bind_contextvars(job_id=job_id)
            return await self._reply_error(message, error_reply(job_id, "invalid_request", str(e)))

        job_id = req.id or message.message_id
        structlog.contextvars.bind_contextvars(job_id=job_id)
        if reply_to is None:
            log.warning("job without reply_to: nowhere to answer, dead-lettered")
            return Result(Outcome.DEAD_LETTER, "unanswerable")

        def fail(code: str, msg: str, retryable: bool | None = None) -> Any:
            return self._reply_error(message, error_reply(job_id, code, msg, retryable))

        if req.deadline_ms is not None and time.time() * 1000 >= req.deadline_ms:
            late = time.time() * 1000 - req.deadline_ms
            return await fail("deadline_exceeded",
                              f"deadline_ms={req.deadline_ms} passed {late:.0f} ms before the job "
                              f"was received; send a later deadline or none")
        src = req.src_lang or self.settings.default_src_lang
        tgt = req.tgt_lang or self.settings.default_tgt_lang
        if src is None or tgt is None:
            missing = "src_lang" if src is None else "tgt_lang"
            return await fail("invalid_request",
                              f"missing field '{missing}' and this worker has no default "
                              f"(NLLB_DEFAULT_{missing.upper()}); give it in the job")
        segments = req.segments
        if len(segments) > self.settings.max_segments:
            return await fail("too_long", f"the job has {len(segments)} segments; this worker "
                              f"takes at most {self.settings.max_segments} (NLLB_MAX_SEGMENTS); "
                              f"split it into several jobs")
        try:
            options = build_options(req)
        except InvalidRequest as e:
            return await fail("invalid_request", str(e))

        structlog.contextvars.bind_contextvars(segments=len(segments),
                                               chars=sum(len(s) for s in segments))
        deadline = req.deadline_ms / 1000 if req.deadline_ms is not None else None
        t_submit = time.monotonic()
        try:
            cfut = self.engine.submit(segments, src, tgt, options=options, adapter=req.adapter,
                                      deadline=deadline)
        except EngineFailure as e:
            raise _Requeue("engine_failure", str(e)) from None
        except EngineError as e:
            return await fail(e.code, str(e), e.retryable)
        except Exception as e:
            log.exception("engine.submit raised an untyped error")
            return await fail("internal", f"internal error: {type(e).__name__}: {e}", True)

        results = await self._await_engine(cfut)
        if isinstance(results, BaseException):
            e = results
            if isinstance(e, EngineFailure):
                raise _Requeue("engine_failure", str(e))
            if isinstance(e, EngineError):
                return await fail(e.code, str(e), e.retryable)
            log.error("engine job failed with an untyped error", error=repr(e))
            return await fail("internal", f"internal error: {type(e).__name__}: {e}", True)
        t_done = time.monotonic()
        started = cfut.started_at if cfut.started_at is not None else t_submit
        compute_s = t_done - started  # from taking rows to the last segment's result
        reply = ok_reply(req, job_id, src, tgt, self.engine.model_name, results,
                         queued_ms=(started - t0_mono(t_recv)) * 1e3, compute_ms=compute_s * 1e3)
        self.metrics.translated(req.adapter, reply.usage.tgt_tokens, compute_s)
        structlog.contextvars.bind_contextvars(src_tokens=reply.usage.src_tokens,
                                               tgt_tokens=reply.usage.tgt_tokens,
                                               compute_ms=round(compute_s * 1e3, 3))
        return await self._publish(message, reply, Outcome.OK)

    async def _await_engine(self, cfut: concurrent.futures.Future) -> Any:
        """The engine's result, or its exception; _Requeue when the shutdown budget ran out."""
        assert self._abort is not None
        afut = asyncio.wrap_future(cfut)
        done, _ = await asyncio.wait({afut, self._abort}, return_when=asyncio.FIRST_COMPLETED)
        if afut not in done:
            cfut.cancel()  # drops it if not admitted yet
            afut.cancel()
            raise _Requeue("shutdown")
        if afut.cancelled():
            raise _Requeue("engine_cancelled")
        exc = afut.exception()
        return exc if exc is not None else afut.result()

    async def _reply_error(self, message: AbstractIncomingMessage, reply: ErrorReply) -> Result:
        log.info("job answered with an error", code=reply.error.code, error=reply.error.message)
        return await self._publish(message, reply, Outcome.ERROR)

    async def _publish(self, message: AbstractIncomingMessage, reply: OkReply | ErrorReply,
                       outcome: Outcome) -> Result:
        code = reply.error.code if isinstance(reply, ErrorReply) else ""
        body = dump_reply(reply)
        assert message.reply_to
        published = await self.broker.publish(body, message.reply_to,
                                              correlation_id=message.correlation_id,
                                              abort=self._abort)
        if published is Published.RETURNED:
            log.warning("reply returned unroutable (reply queue gone); acking", reply_to=message.reply_to)
            return Result(Outcome.REPLY_RETURNED, code, reply)
        if published is Published.GAVE_UP:
            raise _Requeue("reply_not_confirmed")
        return Result(outcome, code, reply)


def t0_mono(t_wall: float) -> float:
    """A wall-clock instant converted to the monotonic clock (for spans that start at receipt)."""
    return time.monotonic() - (time.time() - t_wall)
