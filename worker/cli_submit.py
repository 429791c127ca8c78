"""`nllb-worker submit` (jobs through the broker) and `nllb-worker cancel`.

`submit` sends one job per input line and prints each reply as a JSON line, or with `--document` one
document job whose translation it prints in the source's layout, a progress bar driven by the
worker's `partial` messages on stderr; Ctrl-C there cancels the job on the workers. Output warnings
and detected languages (`--src auto`) are named on stderr, and so are the jobs' ids (`submit-<run>-<line index>`,
`submit-<run>-document`, <run> random: ids of other users' runs never collide), for `nllb-worker cancel`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import uuid
from collections.abc import Iterator
from typing import Any

from worker.cli_input import (UsageError, excerpt, is_blank, job_options, languages, read_document, read_segments,
                              warn)
from worker.client import ClientError, NllbClient
from worker.messages import ErrorReply, OkReply, error_reply
from worker.settings import Settings, redact_url

CANCEL_WAIT_S = 10.0  # after Ctrl-C: how long to wait for the worker's `cancelled` answer
INTERRUPTED = 130  # exit status after Ctrl-C, as a shell gives


@contextlib.contextmanager
def amqp_logs_quiet() -> Iterator[None]:
    """aio-pika's and aiormq's own logs off (a lost connection's tracebacks, every reconnection attempt): what they
    mean reaches the user once, as a UsageError or as the error lines of the jobs it failed."""
    amqp_logs = [logging.getLogger(name) for name in ("aio_pika", "aiormq")]
    levels = [lg.level for lg in amqp_logs]
    for lg in amqp_logs:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(amqp_logs, levels):
            lg.setLevel(level)


async def connect(client: NllbClient) -> None:
    """The client's first connection; a broker that can't be reached is one line (UsageError)."""
    from worker.amqp import CONNECTION_ERRORS

    try:
        await asyncio.wait_for(client.connect(), 15)
    except (asyncio.TimeoutError, OSError, *CONNECTION_ERRORS) as e:
        raise UsageError(f"cannot reach the broker at {redact_url(client.url)}: {e or type(e).__name__}") from None
    except ValueError:  # the URL's parser: its message may quote a piece of the password
        raise UsageError(f"not a usable AMQP URL: {redact_url(client.url)} (a password with / ? # @ must be "
                         f"percent-encoded)") from None


async def open_client(args: argparse.Namespace) -> NllbClient:
    """A connected client; no jobs queue is a UsageError, no consumer of it a note on stderr."""
    from worker.client import JobNotRouted

    client = NllbClient(args.url, args.queue, name="nllb-submit", control_exchange=args.exchange)
    await connect(client)
    try:
        consumers = await client.consumer_count()
    except JobNotRouted as e:
        await client.close()
        raise UsageError(str(e)) from None
    if consumers == 0:
        print(f"no worker consumes {args.queue!r} now: the jobs wait in the queue until one starts "
              f"(`nllb-worker run`), at most --timeout {args.timeout:g} s each", file=sys.stderr)
    return client


def job_id_prefix() -> str:
    """`submit-<run>`: <run> is random, as two containers' submits both run as PID 1."""
    return f"submit-{uuid.uuid4().hex[:12]}"


def job_failed(job_id: str, e: ClientError) -> ErrorReply:
    """What the client could not see through, as the job's error reply."""
    return error_reply(job_id, e.code, str(e), retryable=e.retryable)


def show_translation_notes(where: str, reply: OkReply) -> None:
    """A texts job's warnings and detected languages, on stderr."""
    for t in reply.translations or []:
        if t.detected_lang is not None:
            print(f"detected: {where}: {t.detected_lang} (confidence {t.detected_confidence:.2f})",
                  file=sys.stderr)
        warn(where, t.warnings)


async def _submit(args: argparse.Namespace, segments: list[str], src: str, tgt: str) -> int:
    from tqdm import tqdm

    from worker.messages import dump_reply

    opts = job_options(args.options).model_dump(exclude_unset=True) or None
    client = await open_client(args)
    prefix = job_id_prefix()
    print(f"nllb-worker submit: job ids {prefix}-<index>, the input line's index from 0 "
          f"(`nllb-worker cancel ID` cancels one)", file=sys.stderr)
    errors = 0
    try:
        bar = tqdm(total=len(segments), disable=not args.file, file=sys.stderr, unit="job")
        sem = asyncio.Semaphore(args.concurrency)

        async def one(i: int, text: str) -> Any:
            job_id = f"{prefix}-{i}"
            async with sem:
                try:
                    return await client.translate([text], src, tgt, adapter=args.adapter, options=opts,
                                                  job_id=job_id, timeout=args.timeout)
                except asyncio.TimeoutError:
                    return error_reply(job_id, "timeout", f"no reply within --timeout {args.timeout:g} s; "
                                       "the job may still be answered later", retryable=True)
                except ClientError as e:
                    return job_failed(job_id, e)
                finally:
                    bar.update(1)

        tasks = [None if is_blank(s) else asyncio.create_task(one(i, s)) for i, s in enumerate(segments)]
        for line, (task, source) in enumerate(zip(tasks, segments), 1):  # in input order, as they complete
            if task is None:
                sys.stdout.write("\n")
                continue
            reply = await task
            errors += reply.status != "ok"
            if isinstance(reply, OkReply):
                show_translation_notes(f"line {line} {excerpt(source)}", reply)
            sys.stdout.write(dump_reply(reply).decode() + "\n")
            sys.stdout.flush()
        bar.close()
    finally:
        await client.close()
    return 1 if errors else 0


class Interrupt:
    """Ctrl-C while a document job runs: the first sets `first`, a second sets `again`."""

    def __init__(self) -> None:
        self.first, self.again = asyncio.Event(), asyncio.Event()

    def __call__(self) -> None:
        (self.again if self.first.is_set() else self.first).set()


async def _submit_document(args: argparse.Namespace, document: str, src: str, tgt: str) -> int:
    """One document job with progress; its translation (or with --json its reply) on stdout."""
    from tqdm import tqdm

    from worker.messages import dump_reply

    opts = {**job_options(args.options).model_dump(exclude_unset=True), "progress": True}
    job_id = f"{job_id_prefix()}-document"
    client = await open_client(args)
    print(f"nllb-worker submit: job {job_id} (Ctrl-C or `nllb-worker cancel {job_id}` cancels it)", file=sys.stderr)
    loop = asyncio.get_running_loop()
    interrupt = Interrupt()
    loop.add_signal_handler(signal.SIGINT, interrupt)
    bar = tqdm(file=sys.stderr, unit="segment", desc="segments")

    def on_progress(partial: dict[str, Any]) -> None:  # `total` is the sentences, known once split
        bar.total, bar.n = partial.get("total"), partial.get("done", bar.n)
        bar.refresh()

    try:
        try:
            fut = await client.publish(client.job_body(None, src, tgt, document=document, adapter=args.adapter,
                                                       options=opts, job_id=job_id), on_progress=on_progress)
        except ClientError as e:
            raise UsageError(str(e)) from None
        reply_task = asyncio.ensure_future(client.wait(fut, args.timeout))
        first = asyncio.ensure_future(interrupt.first.wait())
        await asyncio.wait({reply_task, first}, return_when=asyncio.FIRST_COMPLETED)
        if not reply_task.done():
            bar.leave = False
            bar.close()
            return await _cancel_on_interrupt(client, job_id, reply_task, interrupt)
        first.cancel()
        try:
            reply = reply_task.result()
        except asyncio.TimeoutError:
            raise UsageError(f"no reply within --timeout {args.timeout:g} s; the job {job_id!r} may still "
                             "be answered later (cancel it with `nllb-worker cancel`)") from None
        except ClientError as e:
            reply = job_failed(job_id, e)
        if isinstance(reply, OkReply):
            bar.total = bar.n = reply.usage.segments or bar.n
            bar.refresh()
    finally:
        bar.close()
        loop.remove_signal_handler(signal.SIGINT)
        await client.close()
    if args.json:
        sys.stdout.write(dump_reply(reply).decode() + "\n")
    if isinstance(reply, ErrorReply):
        if not args.json:
            print(f"nllb-worker submit: job {job_id!r} failed: {reply.error.code}: {reply.error.message}",
                  file=sys.stderr)
        return 1
    show_document_notes(reply)
    if not args.json:
        sys.stdout.flush()
        sys.stdout.buffer.write((reply.document or "").encode("utf-8"))  # exactly: line endings too
    sys.stdout.flush()
    return 0


async def _cancel_on_interrupt(client: NllbClient, job_id: str, reply_task: asyncio.Future,
                               interrupt: Interrupt) -> int:
    """Publish the cancel, wait a while for the worker's answer (a second Ctrl-C: not at all), and
    say in one line what happened."""
    try:
        await client.cancel(job_id)
    except Exception as e:  # noqa: BLE001 - the one line says so
        print(f"nllb-worker submit: interrupted; the cancel for job {job_id!r} could not be sent ({e}): "
              f"the job goes on", file=sys.stderr)
        return INTERRUPTED
    again = asyncio.ensure_future(interrupt.again.wait())
    await asyncio.wait({reply_task, again}, timeout=CANCEL_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
    again.cancel()
    reply = reply_task.result() if reply_task.done() and not reply_task.exception() else None
    if reply is None:
        answer = "no answer yet; a worker that gets the job later answers it cancelled"
    elif isinstance(reply, ErrorReply):
        answer = f"the worker answered {reply.error.code}"
    else:
        answer = "it had finished already: the worker answered ok"
    print(f"nllb-worker submit: interrupted; cancel sent for job {job_id!r}: {answer}", file=sys.stderr)
    return INTERRUPTED


def show_document_notes(reply: OkReply) -> None:
    """A document's detected language and warnings, on stderr: by sentence when the reply has them
    (option return_segments), else once for the document."""
    if reply.detected_lang is not None:
        print(f"detected: document: {reply.detected_lang} (confidence {reply.detected_confidence:.2f})",
              file=sys.stderr)
    if reply.segments is not None:
        for i, seg in enumerate(reply.segments, 1):
            warn(f"sentence {i} {excerpt(seg.source)}", seg.warnings)
    elif reply.warnings:
        warn("document", reply.warnings)


def cmd_submit(args: argparse.Namespace) -> int:
    settings = Settings()
    if args.document and (args.texts or args.file):
        raise UsageError("give --document alone, without texts or --file")
    document = read_document(args.document) if args.document else None
    segments = read_segments(args) if document is None else []
    src, tgt = languages(args, settings)
    job_options(args.options)  # a mistake is reported before connecting
    args.url = args.url or settings.amqp_url.get_secret_value()
    args.queue = args.queue or settings.jobs_queue
    args.exchange = args.exchange or settings.control_exchange  # where Ctrl-C sends the cancel
    with amqp_logs_quiet():
        if document is not None:
            return asyncio.run(_submit_document(args, document, src, tgt))
        return asyncio.run(_submit(args, segments, src, tgt))


async def _cancel(args: argparse.Namespace) -> int:
    from worker.client import JobNotRouted

    client = NllbClient(args.url, name="nllb-cancel", control_exchange=args.exchange)
    await connect(client)
    try:
        await client.cancel(args.job_id)
    except JobNotRouted as e:
        raise UsageError(str(e)) from None
    finally:
        await client.close()
    print(f"cancel sent for job {args.job_id!r} to {args.exchange!r}", file=sys.stderr)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    settings = Settings()
    args.url = args.url or settings.amqp_url.get_secret_value()
    args.exchange = args.exchange or settings.control_exchange
    with amqp_logs_quiet():
        return asyncio.run(_cancel(args))


def add_cancel_command(sub: Any) -> None:
    p = sub.add_parser("cancel", help="cancel a job by its id (the worker holding it answers `cancelled`)",
                       description="Publish a cancel for JOB_ID to the control exchange: the worker that holds "
                                   "the job, queued or decoding, frees its rows and answers it `cancelled`; "
                                   "an id no worker knows is ignored. Exit status: 0 sent, 2 a mistake.")
    p.add_argument("job_id", metavar="JOB_ID", help="the job's id (its `id`, else its message_id)")
    p.add_argument("--url", default=None, help="AMQP URL of the broker (default: NLLB_AMQP_URL, "
                                              "amqp://guest:guest@127.0.0.1:5672/)")
    p.add_argument("--exchange", default=None,
                   help="the workers' control exchange, fanout (default: NLLB_CONTROL_EXCHANGE, nllb.control)")
    p.set_defaults(func=cmd_cancel)
