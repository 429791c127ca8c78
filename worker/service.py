"""message → job → engine → reply → ack (or reject: `worker.outcomes` decides).

The path of one delivery (one asyncio task each, `Service._handle`, started by `Service._on_message`
as aiormq hands the delivery over):

1. `job.parse` the body (strict pydantic models of docs/protocol.md), on a worker thread;
2. `job.check` what the worker owns (deadline on receipt, languages present, segment and
   document limits, options);
3. `Service._run`: a job whose id was cancelled is answered `cancelled` at once; otherwise it is
   submitted to the engine on a worker thread (it tokenizes, detects languages and splits
   documents, and raises input errors synchronously), then its future is awaited without blocking
   the loop, while `control.Cancellations` may cancel it and `progress.Progress` publishes its
   `partial` messages (option progress);
4. `job.ok_reply`, or the `Refused` error's reply; `Service._publish` it (confirmed, mandatory) on
   the current channel, after a reconnection too, after the job's last partial;
5. `Service._handle` settles the delivery as `worker.outcomes.decide` says.

When the consuming channel closes (a connection lost, say), the deliveries that came on it stop where
they are (`_on_channel_lost`): their engine jobs are cancelled and nothing more is published for them, so
that the redelivery, here or at another worker, gives the one answer.
"""
from __future__ import annotations

import asyncio
import contextvars
import time
from functools import partial

import structlog

from engine import DocumentTranslation, JobFuture, Translation
from engine.errors import Cancelled, EngineError, EngineFailure
from engine.languages import AUTO, FLORES_CODES
from worker.amqp import Broker, Delivery, Published, Settle, settle
from worker.control import Cancellations
from worker.engine_api import EngineAPI
from worker.handoff import Aborted, EngineWaits, Offload
from worker.job import (
    Job,
    Ran,
    Received,
    Refused,
    Unanswerable,
    check,
    engine_refusal,
    monotonic_of,
    ok_reply,
    parse,
)
from worker.messages import clip, dump_body, dump_reply
from worker.metrics import Metrics
from worker.outcomes import REQUEUE_OUTCOMES, Outcome, Requeue, Result, decide
from worker.progress import Progress
from worker.settings import Settings

log = structlog.get_logger("worker.service")

#: bodies and texts this large are parsed / tokenized on a thread of their own, not in the batch
#: of small jobs that share one (handoff.Offload): they would hold those up for milliseconds
HEAVY_BYTES = 64 * 1024
HEAVY_CHARS = 16 * 1024


def _cancel_submitted(submitting: asyncio.Future[JobFuture]) -> None:
    """Cancel the job a stopped delivery's submission put into the engine (a refusal needs nothing; a job that
    finished meanwhile ignores it)."""
    if not submitting.cancelled() and submitting.exception() is None:
        submitting.result().cancel()


class Service:
    """Consumes the jobs queue into the engine. `run()` until `stop()`; then drains and exits."""

    def __init__(self, settings: Settings, engine: EngineAPI, metrics: Metrics | None = None,
                 name: str = "nllb-worker", owns_engine: bool = True) -> None:
        self.settings = settings
        self.owns_engine = owns_engine  # close it on shutdown
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.broker = Broker(settings, self.metrics, name=name)
        self._tasks: dict[asyncio.Task[None], Delivery] = {}  # each delivery's task, until it is settled
        self._stopping = False
        self._stop_event: asyncio.Event | None = None
        self._abort = asyncio.Event()  # set when the drain's budget ran out
        self._stats_task: asyncio.Task[None] | None = None
        self._engine_closed = False
        self._last_progress = (time.monotonic(), -1)
        # a job holds a prefetch slot from delivery to ack but a row only while it decodes: with one slot a
        # row, jobs being parsed, tokenized, replied to and confirmed left rows idle (toy model, 2-core
        # machine: median 930 -> 1,055 jobs/s with twice the rows, bench.worker_rate); broker processes that
        # share one engine share those slots
        self.prefetch = settings.prefetch or max(1, -(-2 * int(engine.rows_total) // settings.broker_processes))
        self.cancellations = Cancellations(settings.cancel_memory_s)
        self._offload = Offload()  # parsing and submission, batched per loop iteration
        self._engine_waits = EngineWaits()  # the engine's results, batched per loop wake-up
        self._log = log  # every job's "job settled" line: bound once logging is configured (start)
        self.metrics.in_flight.set_function(self.in_flight)  # read at scrape time, not counted at every job

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        self._log = log.bind()  # the module's logger is a proxy that builds a logger at every call
        self.metrics.rows_total.set(self.engine.rows_total)
        await self.broker.connect(self.prefetch)
        await self.broker.consume_control(self.cancellations.on_control)
        await self.broker.consume(self._on_message, self._on_channel_lost)
        self._stats_task = loop.create_task(self._poll_stats(), name="engine-stats")

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
        """Stop consuming, drain in-flight jobs within drain_timeout_s, hand the rest back to the
        queue, close."""
        self._stopping = True
        log.info("stopping: consumer cancelled, draining", in_flight=len(self._tasks),
                 drain_timeout_s=self.settings.drain_timeout_s)
        await self.broker.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=self.settings.drain_timeout_s)
            if pending:
                log.warning("drain timeout: handing unfinished jobs back to the queue",
                            jobs=len(pending))
                self._abort.set()
                self._engine_waits.abort_all()
                await asyncio.wait(pending, timeout=15)
        if self._stats_task:
            self._stats_task.cancel()
        self._offload.close()
        await self.close_engine()
        await self.broker.close()
        log.info("stopped", jobs_ok=self.metrics.count("ok"))

    def in_flight(self) -> int:
        """Deliveries held (received, not yet settled)."""
        return len(self._tasks)

    async def abandon(self) -> None:
        """Close the connection at once: the broker requeues every delivery not yet settled."""
        self._stopping = True
        await asyncio.wait_for(self.broker.close(), 2)

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
                self.metrics.rows_freed_by_cancel.set(s.rows_freed_by_cancel)
                self.metrics.engine_cancelled.set(s.cancelled_jobs)
            except Exception as e:  # noqa: BLE001
                log.warning("engine stats failed", error=repr(e))
            await asyncio.sleep(1.0)

    # --- one delivery -------------------------------------------------------------------------

    def _on_message(self, message: Delivery) -> None:
        # a task of the worker's, since closing the channel cancels aiormq's consumer tasks; in a
        # fresh context, so contextvars bound for the job never leak into another
        loop = asyncio.get_running_loop()
        task = contextvars.Context().run(loop.create_task, self._handle(message))
        self._tasks[task] = message
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        del self._tasks[task]

    def _on_channel_lost(self, channel: object) -> None:
        """The channel the jobs came on closed: the broker requeued every one of them not yet settled, and a
        redelivery will answer it. Their tasks are cancelled where they are (the engine's job with them), so
        that none is answered twice, nor gets a partial after a final reply from its redelivery."""
        orphans = [task for task, message in self._tasks.items() if message.channel is channel]
        for task in orphans:
            task.cancel()
        if orphans:
            log.warning("the jobs channel closed: its jobs were requeued by the broker; stopping them here",
                        jobs=len(orphans))

    async def _handle(self, message: Delivery) -> None:
        t0 = time.monotonic()
        structlog.contextvars.bind_contextvars(job_id=message.properties.message_id,
                                               delivery=message.delivery_tag,
                                               redelivered=message.redelivered)
        try:
            result = await self._outcome(message)
        except asyncio.CancelledError:
            if not message.channel.is_closed:
                raise
            self.metrics.job_done("stale", "channel_closed")
            self._log.info("job stopped: its channel closed and the broker requeued it", outcome="stale")
            return
        action = decide(result.outcome)
        settled = await settle(message, action, self.broker)
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
        self._log.info("job settled", outcome=result.outcome.value, code=result.code or None,
                       action=action, settle=settled.value,
                       total_ms=round((time.monotonic() - t0) * 1e3, 3), **(result.details or {}))

    async def _outcome(self, message: Delivery) -> Result:
        """The delivery's outcome: what `_process` returned, or what it raised."""
        if self._stopping:
            return Result(Outcome.HANDED_BACK, "shutdown")
        try:
            return await self._process(message)
        except Unanswerable:
            log.warning("job without reply_to: nowhere to answer, dead-lettered",
                        bytes=len(message.body))
            return Result(Outcome.DEAD_LETTER, "unanswerable")
        except Requeue as r:
            if r.detail:
                log.warning("requeueing the job", reason=r.reason, detail=r.detail)
            return Result(REQUEUE_OUTCOMES[r.reason], r.reason)
        except Exception:  # a worker bug: requeue; the delivery limit stops a loop
            log.exception("job handling failed unexpectedly; requeueing")
            return Result(Outcome.REQUEUE, "worker_error")

    async def _process(self, message: Delivery) -> Result:
        """parse → check → run → reply, then publish the reply."""
        p = message.properties
        received = Received(message.body, p.reply_to or None, p.message_id, time.time())
        if p.timestamp is not None:
            self.metrics.queue_wait.observe(max(0.0, received.received_at - p.timestamp.timestamp()))
        try:
            request = await self._offload.call(partial(parse, received, self.settings.max_message_bytes),
                                               heavy=len(received.body) > HEAVY_BYTES)
            job = check(request, received, self.settings)
            structlog.contextvars.bind_contextvars(
                job_id=job.id, segments=len(job.segments),
                chars=len(job.document) if job.document is not None else sum(map(len, job.segments)))
            progress = None
            if job.request.options.progress:
                progress = Progress(job.id, partial(self._publish_partial, message))
            ran = await self._run(job, received, progress)
        except Refused as refused:
            error = refused.reply(received.message_id)
            structlog.contextvars.bind_contextvars(job_id=error.id)
            log.info("job answered with an error", code=refused.code, error=refused.message)
            return await self._publish(message, dump_reply(error), Outcome.ERROR, refused.code)
        reply = ok_reply(job, ran, self.engine.model_name)
        usage = reply["usage"]
        self.metrics.translated(job.request.adapter, usage["tgt_tokens"], ran.compute_s)
        self._count_text_services(job, ran)
        result = await self._publish(message, dump_body(reply), Outcome.OK)
        result.details = {"src_tokens": usage["src_tokens"], "tgt_tokens": usage["tgt_tokens"],
                          "compute_ms": reply["timings_ms"]["compute"]}
        return result

    async def _run(self, job: Job, received: Received, progress: Progress | None = None) -> Ran:
        """The engine's answer to a checked job, its partial messages published by `progress`.
        Refused for what the engine refuses and for a cancelled job; Requeue when the engine
        failed or the shutdown budget ran out."""
        if self.cancellations.cancelled(job.id):
            self.metrics.cancellations.labels("arrived").inc()
            raise Refused("cancelled", f"job {clip(job.id or '')!r} was cancelled before it arrived",
                          job_id=job.id)
        t_submit = time.monotonic()
        future: JobFuture | None = None
        try:
            heavy = job.document is not None or sum(map(len, job.segments)) > HEAVY_CHARS
            submitting = self._offload.call(partial(self._submit, job, progress), heavy=heavy)
            future = await asyncio.shield(submitting)  # a stopped delivery still learns which job it put in
            if progress is not None:
                progress.start(future.total)
            with self.cancellations.holding(job.id, future):
                answer = await self._await_engine(future)
        except asyncio.CancelledError:  # its delivery's channel closed (_on_channel_lost): the engine's job is
            submitting.add_done_callback(_cancel_submitted)  # cancelled, now or once the engine has taken it
            raise
        except Cancelled as e:
            self.metrics.cancellations.labels("waiting" if future is None or future.started_at is None
                                              else "running").inc()
            raise engine_refusal(e, job, self.settings) from None
        except EngineFailure as e:
            raise Requeue("engine_failure", str(e)) from None
        except EngineError as e:
            if e.code == "unknown_language" and job.src_lang == AUTO and job.tgt_lang in FLORES_CODES:
                self.metrics.detection_unknown.inc()
            raise engine_refusal(e, job, self.settings) from None
        except Requeue:
            raise
        except Exception as e:  # an engine bug: the producer may retry
            log.error("the engine failed with an untyped error", error=repr(e))
            raise Refused("internal", f"internal error: {type(e).__name__}: {e}", True,
                          job.id) from None
        finally:
            if progress is not None:
                await progress.close()
        started = future.started_at if future.started_at is not None else t_submit
        return Ran(answer, queued_s=started - monotonic_of(received.received_at),
                   compute_s=time.monotonic() - started)

    def _submit(self, job: Job, progress: Progress | None) -> JobFuture:
        """The job into the engine (a worker thread: tokenizing, detection and splitting take
        time); its future."""
        on_segment = progress.on_segment if progress is not None else None
        common = dict(options=job.options, adapter=job.request.adapter, deadline=job.deadline,
                      on_warning=job.request.options.on_warning, job_id=job.id, on_segment=on_segment)
        if job.document is not None:
            return self.engine.submit_document(job.document, job.src_lang, job.tgt_lang,
                                               max_chars=self.settings.max_document_chars, **common)
        return self.engine.submit(job.segments, job.src_lang, job.tgt_lang, **common)

    async def _publish_partial(self, message: Delivery, body: bytes) -> None:
        p = message.properties
        assert p.reply_to
        await self.broker.publish_interim(body, p.reply_to, correlation_id=p.correlation_id)
        self.metrics.partials.inc()

    def _count_text_services(self, job: Job, ran: Ran) -> None:
        if isinstance(ran.answer, DocumentTranslation):
            translations = [s.translation for s in ran.answer.segments]
            detected = [ran.answer.detected_lang] if ran.answer.detected_lang else []
        else:
            translations = ran.answer
            detected = [t.detected_lang for t in translations if t.detected_lang]
        self.metrics.text_services(job.src_lang, job.tgt_lang, translations, detected)

    async def _await_engine(self, future: JobFuture) -> list[Translation] | DocumentTranslation:
        """The engine's result (or its exception, raised); Requeue when the shutdown budget ran out."""
        try:
            return await self._engine_waits.wait(future)
        except Aborted:
            future.cancel()  # drops it if not admitted yet
            raise Requeue("shutdown") from None

    async def _publish(self, message: Delivery, body: bytes, outcome: Outcome,
                       code: str = "") -> Result:
        """The reply `body` published (confirmed); `code`: an error reply's."""
        p = message.properties
        assert p.reply_to
        published = await self.broker.publish(body, p.reply_to, correlation_id=p.correlation_id,
                                              abort=self._abort)
        if published in (Published.RETURNED, Published.REFUSED):
            # the job is answered only if its reply arrives: it goes to the dead letters (PROTOCOL: it ends as a
            # reply or as a dead letter), where its producer can find it
            log.warning("reply could not be delivered; dead-lettering the job", reply_to=p.reply_to,
                        reason=published.value)
            return Result(Outcome.UNDELIVERABLE, f"reply_{published.value}")
        if published is Published.GAVE_UP:
            raise Requeue("reply_not_confirmed")
        return Result(outcome, code)
