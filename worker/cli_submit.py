"""`nllb-worker submit` (jobs through the broker, one reply a line) and `nllb-worker cancel`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

from worker.cli import UsageError, is_blank, job_options, languages, read_segments
from worker.client import NllbClient
from worker.settings import Settings, redact_url


async def connect(client: NllbClient) -> None:
    """The client's first connection; a broker that can't be reached is one line (UsageError)."""
    from worker.amqp import CONNECTION_ERRORS

    amqp_logs = [logging.getLogger(name) for name in ("aio_pika", "aiormq")]
    levels = [lg.level for lg in amqp_logs]
    for lg in amqp_logs:
        lg.setLevel(logging.CRITICAL)  # a failed first connection is said once, below
    try:
        await asyncio.wait_for(client.connect(), 15)
    except (asyncio.TimeoutError, OSError, *CONNECTION_ERRORS) as e:
        raise UsageError(f"cannot reach the broker at {redact_url(client.url)}: {e or type(e).__name__}") from None
    finally:
        for lg, level in zip(amqp_logs, levels):
            lg.setLevel(level)


async def _submit(args: argparse.Namespace, segments: list[str], src: str, tgt: str) -> int:
    from tqdm import tqdm

    from worker.client import ClientError, JobNotRouted
    from worker.messages import dump_reply, error_reply

    opts = job_options(args.options).model_dump(exclude_unset=True) or None
    client = NllbClient(args.url, args.queue, name="nllb-submit")
    await connect(client)
    errors = 0
    try:
        try:
            consumers = await client.consumer_count()
        except JobNotRouted as e:
            raise UsageError(str(e)) from None
        if consumers == 0:
            print(f"no worker consumes {args.queue!r} now: the jobs wait in the queue until one starts "
                  f"(`nllb-worker run`), at most --timeout {args.timeout:g} s each", file=sys.stderr)
        bar = tqdm(total=len(segments), disable=not args.file, file=sys.stderr, unit="job")
        sem = asyncio.Semaphore(args.concurrency)

        async def one(i: int, text: str) -> Any:
            job_id = f"submit-{os.getpid()}-{i}"
            async with sem:
                try:
                    return await client.translate([text], src, tgt, adapter=args.adapter, options=opts,
                                                  job_id=job_id, timeout=args.timeout)
                except asyncio.TimeoutError:
                    return error_reply(job_id, "timeout", f"no reply within --timeout {args.timeout:g} s; "
                                       "the job may still be answered later", retryable=True)
                except ClientError as e:
                    return error_reply(job_id, getattr(e, "code", "not_routed"), str(e), retryable=True)
                finally:
                    bar.update(1)

        tasks = [None if is_blank(s) else asyncio.create_task(one(i, s)) for i, s in enumerate(segments)]
        for task in tasks:  # in input order, as they complete
            if task is None:
                sys.stdout.write("\n")
                continue
            reply = await task
            errors += reply.status != "ok"
            sys.stdout.write(dump_reply(reply).decode() + "\n")
            sys.stdout.flush()
        bar.close()
    finally:
        await client.close()
    return 1 if errors else 0


def cmd_submit(args: argparse.Namespace) -> int:
    settings = Settings()
    segments = read_segments(args)
    src, tgt = languages(args, settings)
    job_options(args.options)  # a mistake is reported before connecting
    args.url = args.url or settings.amqp_url.get_secret_value()
    args.queue = args.queue or settings.jobs_queue
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
    args.url = args.url or Settings().amqp_url.get_secret_value()
    return asyncio.run(_cancel(args))


def add_cancel_command(sub: Any) -> None:
    from worker.client import CONTROL_EXCHANGE

    p = sub.add_parser("cancel", help="cancel a job by its id (the worker holding it answers `cancelled`)",
                       description="Publish a cancel for JOB_ID to the control exchange: the worker that holds "
                                   "the job, queued or decoding, frees its rows and answers it `cancelled`; "
                                   "an id no worker knows is ignored. Exit status: 0 sent, 2 a mistake.")
    p.add_argument("job_id", metavar="JOB_ID", help="the job's id (its `id`, else its message_id)")
    p.add_argument("--url", default=None, help="AMQP URL of the broker (default: NLLB_AMQP_URL, "
                                              "amqp://guest:guest@127.0.0.1:5672/)")
    p.add_argument("--exchange", default=CONTROL_EXCHANGE,
                   help=f"the workers' control exchange, fanout (default: {CONTROL_EXCHANGE})")
    p.set_defaults(func=cmd_cancel)
