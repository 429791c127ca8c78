"""The job commands of `nllb-worker`: `translate` (a local engine) and `submit` (through the broker).

Input is one segment a line; a blank or whitespace-only line is not translated and comes back as an
empty output line in its place, so output line i always answers input line i. A user's mistake
(a missing or unknown language, bad options, a missing file, no broker or no jobs queue) raises
UsageError: `main` prints its message as one line and exits 2.
"""
from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import structlog
from pydantic import ValidationError

from worker.messages import JobOptions
from worker.settings import Settings, redact_url

if TYPE_CHECKING:
    from engine import Engine

log = structlog.get_logger("worker")


class UsageError(Exception):
    """A mistake of the user's: printed as one line, exit status 2."""


# --- argument types -----------------------------------------------------------------------------

def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer (1 or more)")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


# --- inputs -------------------------------------------------------------------------------------

def read_segments(args: argparse.Namespace) -> list[str]:
    """The input lines: the positional texts, else --file (a path or '-'), else stdin. Blank lines kept."""
    if args.file:
        if args.texts:
            raise UsageError("give texts as arguments or with --file, not both")
        if args.file == "-":
            return _read_lines(sys.stdin, "stdin")
        try:
            with open(args.file, encoding="utf-8") as f:
                return _read_lines(f, f"--file {args.file}")
        except OSError as e:
            raise UsageError(f"--file {args.file}: {e.strerror or e}") from None
    if args.texts:
        return list(args.texts)
    if sys.stdin.isatty():
        raise UsageError("no texts: give them as arguments, with --file PATH, or on stdin")
    return _read_lines(sys.stdin, "stdin")


def _read_lines(stream: TextIO, what: str) -> list[str]:
    try:
        return stream.read().splitlines()
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def is_blank(segment: str) -> bool:
    return not segment.strip()


def languages(args: argparse.Namespace, settings: Settings) -> tuple[str, str]:
    """--src/--tgt (defaults NLLB_DEFAULT_SRC_LANG/NLLB_DEFAULT_TGT_LANG), checked against NLLB-200's codes."""
    from engine.errors import UnknownLanguage
    from engine.languages import check_language
    out = []
    for flag, given, default in (("--src", args.src, settings.default_src_lang),
                                 ("--tgt", args.tgt, settings.default_tgt_lang)):
        code = given or default
        if not code:
            raise UsageError(f"{flag} is required (e.g. {flag} eng_Latn), or set NLLB_DEFAULT_"
                             f"{flag[2:].upper()}_LANG")
        try:
            out.append(check_language(code, flag))
        except UnknownLanguage as e:
            raise UsageError(str(e)) from None
    return out[0], out[1]


def job_options(text: str | None) -> JobOptions:
    """--options: a JSON object of PROTOCOL.md option names, checked as the worker checks a job's."""
    if not text:
        return JobOptions()
    example = "e.g. --options '{\"num_beams\": 4}'"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--options is not JSON ({e}); {example}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--options must be a JSON object; {example}")
    known = list(JobOptions.model_fields)
    for name in data:
        if name not in JobOptions.model_fields:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "known: " + ", ".join(known)
            raise UsageError(f"--options: unknown option {name!r}; {hint}")
    try:
        return JobOptions.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise UsageError(f"--options: {'.'.join(map(str, err['loc']))}: {err['msg']} "
                         f"(got {err.get('input')!r})") from None


# --- the local engine ---------------------------------------------------------------------------

def load_engine(settings: Settings) -> Engine:
    """Engine.load with the settings; a model, device or adapters directory that can't be used is a
    UsageError. The log names the device the engine chose (`auto` resolved)."""
    from engine import Engine, EngineError
    from engine.errors import CheckpointError
    kwargs: dict[str, Any] = {"model_dir": settings.model,
                              "device": settings.device, "max_rows": settings.max_rows,
                              "adapters_dir": settings.adapters_dir}
    if settings.adapters_dir is not None and not settings.adapters_dir.is_dir():
        raise UsageError(f"adapters directory {str(settings.adapters_dir)!r} is not a directory")
    if settings.max_adapters is not None:
        kwargs["max_adapters"] = settings.max_adapters
    if settings.max_lora_rank is not None:
        kwargs["max_lora_rank"] = settings.max_lora_rank
    t0 = time.monotonic()
    try:
        engine = Engine.load(**kwargs)
    except (EngineError, CheckpointError) as e:
        raise UsageError(f"cannot load the engine: {e}") from None
    log.info("engine loaded", model=engine.model_name, rows_total=engine.rows_total,
             max_source_tokens=engine.max_source_tokens, device=str(engine.backend.device),
             dtype=str(engine.backend.dtype).removeprefix("torch."), device_setting=settings.device,
             load_s=round(time.monotonic() - t0, 3))
    return engine


def cmd_translate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine import EngineError, GenerationOptions
    from worker.logs import configure

    settings = Settings()
    configure("console" if sys.stderr.isatty() else "json", "warning")
    segments = read_segments(args)
    src, tgt = languages(args, settings)
    try:
        gen = GenerationOptions(**job_options(args.options).generation_fields())
    except EngineError as e:
        raise UsageError(f"--options: {e}") from None
    model = Path(args.model) if args.model else settings.model
    adapters_dir = args.adapters_dir or settings.adapters_dir
    if adapters_dir is None and model is None:
        from engine import TOY_ADAPTERS_DIR
        adapters_dir = TOY_ADAPTERS_DIR  # the bundled toy model comes with its adapter
    if args.adapter and adapters_dir is None:
        raise UsageError(f"--adapter {args.adapter!r} needs an adapters directory: --adapters-dir DIR or "
                         "NLLB_ADAPTERS_DIR")
    settings = settings.model_copy(update={"device": args.device or settings.device, "model": model,
                                           "adapters_dir": adapters_dir})
    engine = load_engine(settings)
    try:
        bar = tqdm(total=len(segments), disable=not args.file, file=sys.stderr, unit="line")
        for start in range(0, len(segments), args.batch):
            chunk = segments[start:start + args.batch]
            todo = [s for s in chunk if not is_blank(s)]
            try:
                done = iter(engine.translate(todo, src, tgt, options=gen, adapter=args.adapter) if todo else [])
            except EngineError as e:
                raise UsageError(str(e)) from None
            for source in chunk:
                t = None if is_blank(source) else next(done)
                if args.json:
                    print(json.dumps({"source": source, "text": t.text if t else "",
                                      "tokens": list(t.tokens) if t else [],
                                      "score": float(t.score) if t and t.score is not None else None},
                                     ensure_ascii=False))
                else:
                    print(t.text if t else "")
            sys.stdout.flush()
            bar.update(len(chunk))
        bar.close()
    finally:
        engine.close()
    return 0


# --- through the broker -------------------------------------------------------------------------

async def _submit(args: argparse.Namespace, segments: list[str], src: str, tgt: str) -> int:
    from tqdm import tqdm

    from worker.amqp import CONNECTION_ERRORS
    from worker.client import ClientError, JobNotRouted, NllbClient
    from worker.messages import dump_reply, error_reply

    opts = job_options(args.options).model_dump(exclude_unset=True) or None
    client = NllbClient(args.url, args.queue, name="nllb-submit")
    amqp_logs = [logging.getLogger(name) for name in ("aio_pika", "aiormq")]
    levels = [lg.level for lg in amqp_logs]
    for lg in amqp_logs:
        lg.setLevel(logging.CRITICAL)  # a failed first connection is said once, below
    try:
        await asyncio.wait_for(client.connect(), 15)
    except (asyncio.TimeoutError, OSError, *CONNECTION_ERRORS) as e:
        raise UsageError(f"cannot reach the broker at {redact_url(args.url)}: {e or type(e).__name__}") from None
    finally:
        for lg, level in zip(amqp_logs, levels):
            lg.setLevel(level)
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


# --- the parsers --------------------------------------------------------------------------------

def _job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("texts", nargs="*", help="texts to translate, one segment each (default: --file, else stdin)")
    p.add_argument("--file", help="read one segment a line from FILE ('-' = stdin), show a progress bar on "
                                  "stderr; a blank line gives an empty output line in its place "
                                  "(default: none)")
    p.add_argument("--src", default=None, help="source language, a FLORES-200 code such as eng_Latn "
                                               "(default: NLLB_DEFAULT_SRC_LANG; required if unset)")
    p.add_argument("--tgt", default=None, help="target language, e.g. fra_Latn "
                                               "(default: NLLB_DEFAULT_TGT_LANG; required if unset)")
    p.add_argument("--adapter", default=None, help="LoRA adapter name, a folder of the adapters directory "
                                                   "(default: none, the base model)")
    p.add_argument("--options", default=None,
                   help='generation options as a JSON object (names in docs/protocol.md), e.g. '
                        '\'{"num_beams": 4}\' (default: the model\'s: greedy, its max length)')


def add_job_commands(sub: Any) -> None:
    p = sub.add_parser("submit", help="publish jobs to the broker (a worker must be running); replies as "
                                      "JSON lines",
                       description="Publish one job per segment to the jobs queue and print each reply as "
                                   "a JSON line, in input order. A worker must be running "
                                   "(`nllb-worker run`). Exit status: 0 all ok, 1 some failed, 2 a mistake.")
    _job_args(p)
    p.add_argument("--url", default=None, help="AMQP URL of the broker; it may carry a password, which then "
                                              "shows in the process list (default: NLLB_AMQP_URL, "
                                              "amqp://guest:guest@127.0.0.1:5672/)")
    p.add_argument("--queue", default=None, help="jobs queue (default: NLLB_JOBS_QUEUE, nllb.jobs)")
    p.add_argument("--timeout", type=positive_float, default=300.0,
                   help="seconds to wait for each reply; a job without one is printed as an error line "
                        "with code 'timeout' and the others go on (default: 300)")
    p.add_argument("--concurrency", type=positive_int, default=64, help="jobs in flight at once (default: 64)")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("translate", help="translate locally with the engine, no broker",
                       description="Translate on this machine (Engine.translate), one output line per "
                                   "input line. Exit status: 0 done, 2 a mistake.")
    _job_args(p)
    p.add_argument("--model", default=None, help="model directory (default: NLLB_MODEL, else the bundled "
                                                 "toy model)")
    p.add_argument("--adapters-dir", default=None, type=Path,
                   help="directory of LoRA adapters, one folder each (default: NLLB_ADAPTERS_DIR; unset: "
                        "none, or with the bundled toy model its adapters)")
    p.add_argument("--device", default=None, choices=["auto", "cuda", "cpu"],
                   help="engine device (default: NLLB_DEVICE, auto: cuda when a GPU is there)")
    p.add_argument("--batch", type=positive_int, default=32, help="segments per engine call (default: 32)")
    p.add_argument("--json", action="store_true",
                   help="JSON lines with source, text, tokens and score (default: off, the text only)")
    p.set_defaults(func=cmd_translate)
