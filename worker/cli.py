"""The job commands of `nllb-worker`: `translate` (a local engine) and `submit` (through the broker).

Input is one segment a line; a blank or whitespace-only line is not translated and comes back as an
empty output line in its place, so output line i always answers input line i. A user's mistake
(a missing or unknown language, bad options, a missing file, no broker or no jobs queue) raises
UsageError: `main` prints its message as one line and exits 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from worker.cli_input import (UsageError, excerpt, is_blank, job_options, languages, positive_float, positive_int,
                              read_document, read_segments, warn)
from worker.settings import Settings

if TYPE_CHECKING:
    from engine import Engine, GenerationOptions, Translation

log = structlog.get_logger("worker")


# --- the local engine ---------------------------------------------------------------------------

def cpu_threads(settings: Settings) -> int | None:
    """The threads for torch's CPU ops: NLLB_CPU_THREADS; unset, what engine/devices.py cpu_threads_for says for
    the model when the engine will run on the CPU (1 for a small model), else None (torch's default). Decided
    before the engine loads: a thread's OpenMP team is sized at its first parallel op."""
    if settings.cpu_threads is not None:
        return settings.cpu_threads
    import torch
    if settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available()):
        return None
    from engine import TOY_MODEL_DIR
    from engine.config import load_config
    from engine.devices import cpu_threads_for
    from engine.errors import CheckpointError
    try:
        cfg = load_config(Path(settings.model) if settings.model else TOY_MODEL_DIR)
    except (CheckpointError, OSError):
        return None  # load_engine reports what is wrong with the checkpoint
    return cpu_threads_for(cfg)


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
    if settings.detect_threshold is not None:
        kwargs["langid_threshold"] = settings.detect_threshold
    if settings.max_rows_per_job is not None:
        kwargs["max_rows_per_job"] = settings.max_rows_per_job
    kwargs["output_warnings"] = settings.output_warnings
    t0 = time.monotonic()
    try:
        engine = Engine.load(**kwargs)
    except (EngineError, CheckpointError) as e:
        raise UsageError(f"cannot load the engine: {e}") from None
    log.info("engine loaded", model=engine.model_name, rows_total=engine.rows_total,
             max_rows_per_job=engine.scheduler.row_cap, output_warnings=settings.output_warnings,
             max_source_tokens=engine.max_source_tokens, device=str(engine.backend.device),
             dtype=str(engine.backend.dtype).removeprefix("torch."), device_setting=settings.device,
             load_s=round(time.monotonic() - t0, 3))
    if settings.warm_up:
        t0 = time.monotonic()
        graphs = engine.warm_up_sentences()
        if graphs:  # none on the CPU
            log.info("engine warmed up", graphs=graphs, warm_up_s=round(time.monotonic() - t0, 3))
    return engine


def cmd_translate(args: argparse.Namespace) -> int:
    from engine import EngineError, GenerationOptions
    from worker.logs import configure

    settings = Settings()
    configure("console" if sys.stderr.isatty() else "json", "warning")
    if args.document and (args.texts or args.file):
        raise UsageError("give --document alone, without texts or --file")
    document = read_document(args.document) if args.document else None
    segments = read_segments(args) if document is None else []
    src, tgt = languages(args, settings)
    try:
        gen = GenerationOptions(**job_options(args.options).generation_fields())
    except EngineError as e:
        raise UsageError(f"--options: {e}") from None
    engine = load_engine(_local_settings(args, settings))
    try:
        if document is not None:
            _translate_document(engine, args, document, src, tgt, gen)
        else:
            _translate_lines(engine, args, segments, src, tgt, gen)
    except EngineError as e:
        raise UsageError(str(e)) from None
    finally:
        engine.close()
    return 0


def _local_settings(args: argparse.Namespace, settings: Settings) -> Settings:
    """The settings with translate's own --model, --adapters-dir and --device."""
    model = Path(args.model) if args.model else settings.model
    adapters_dir = args.adapters_dir or settings.adapters_dir
    if adapters_dir is None and model is None:
        from engine import TOY_ADAPTERS_DIR
        adapters_dir = TOY_ADAPTERS_DIR  # the bundled toy model comes with its adapter
    if args.adapter and adapters_dir is None:
        raise UsageError(f"--adapter {args.adapter!r} needs an adapters directory: --adapters-dir DIR or "
                         "NLLB_ADAPTERS_DIR")
    # no warm-up: a few lines' graphs are captured as they are needed, in less time than every row count's
    return settings.model_copy(update={"device": args.device or settings.device, "model": model,
                                       "adapters_dir": adapters_dir, "warm_up": False})


def _translate_lines(engine: Engine, args: argparse.Namespace, segments: list[str], src: str, tgt: str,
                     gen: GenerationOptions) -> None:
    from tqdm import tqdm

    bar = tqdm(total=len(segments), disable=not args.file, file=sys.stderr, unit="line")
    for start in range(0, len(segments), args.batch):
        chunk = segments[start:start + args.batch]
        todo = [s for s in chunk if not is_blank(s)]
        done = iter(engine.translate(todo, src, tgt, options=gen, adapter=args.adapter) if todo else [])
        for line, source in enumerate(chunk, start + 1):
            t = None if is_blank(source) else next(done)
            if t is not None:
                warn(f"line {line} {excerpt(source)}", t.warnings)
            if args.json:
                print(json.dumps(_translation_json(source, t), ensure_ascii=False))
            else:
                print(t.text if t else "")
        sys.stdout.flush()
        bar.update(len(chunk))
    bar.close()


def _translation_json(source: str, t: Translation | None) -> dict[str, Any]:
    if t is None:  # a blank line
        return {"source": source, "text": "", "tokens": [], "score": None}
    out = {"source": source, "text": t.text, "tokens": list(t.tokens),
           "score": float(t.score) if t.score is not None else None}
    if t.warnings:
        out["warnings"] = list(t.warnings)
    if t.detected_lang is not None:
        out.update(detected_lang=t.detected_lang, detected_confidence=t.detected_confidence)
    return out


def _translate_document(engine: Engine, args: argparse.Namespace, document: str, src: str, tgt: str,
                        gen: GenerationOptions) -> None:
    """The document in its own layout on stdout; a progress bar of finished sentences on stderr."""
    from tqdm import tqdm

    bar = tqdm(file=sys.stderr, unit="segment", desc="segments")
    try:
        future = engine.submit_document(document, src, tgt, options=gen, adapter=args.adapter,
                                        on_segment=lambda index, t: bar.update(1),
                                        max_chars=max(len(document), 1))  # a local run has no size limit
        bar.total = future.total  # the sentences, known once the document was split
        bar.refresh()
        try:
            result = future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise
    finally:
        bar.close()
    for i, seg in enumerate(result.segments, 1):
        warn(f"sentence {i} {excerpt(seg.source)}", seg.translation.warnings)
    if not args.json:
        sys.stdout.write(result.text)
        return
    out: dict[str, Any] = {"document": result.text, "segments": [
        {"source": seg.source, "text": seg.translation.text,
         **({"warnings": list(seg.translation.warnings)} if seg.translation.warnings else {})}
        for seg in result.segments], "usage": dataclasses.asdict(result.usage)}
    if result.detected_lang is not None:
        out.update(detected_lang=result.detected_lang, detected_confidence=result.detected_confidence)
    print(json.dumps(out, ensure_ascii=False))


# --- the parsers --------------------------------------------------------------------------------

def _job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("texts", nargs="*", help="texts to translate, one segment each (default: --file, else stdin)")
    p.add_argument("--file", help="read one segment a line from FILE ('-' = stdin), show a progress bar on "
                                  "stderr; a blank line gives an empty output line in its place "
                                  "(default: none)")
    p.add_argument("--src", default=None, help="source language, a FLORES-200 code such as eng_Latn, or auto "
                                               "to identify it (default: NLLB_DEFAULT_SRC_LANG; required if "
                                               "unset)")
    p.add_argument("--tgt", default=None, help="target language, e.g. fra_Latn "
                                               "(default: NLLB_DEFAULT_TGT_LANG; required if unset)")
    p.add_argument("--adapter", default=None, help="LoRA adapter name, a folder of the adapters directory "
                                                   "(default: none, the base model)")
    p.add_argument("--options", default=None,
                   help='generation options as a JSON object (names in docs/protocol.md), e.g. '
                        '\'{"num_beams": 4}\' (default: the model\'s: greedy, its max length)')


def add_job_commands(sub: Any) -> None:
    from worker.cli_submit import add_cancel_command, cmd_submit

    p = sub.add_parser("submit", help="publish jobs to the broker (a worker must be running); replies as "
                                      "JSON lines",
                       description="Publish one job per segment to the jobs queue and print each reply as "
                                   "a JSON line, in input order; or with --document one document job, "
                                   "printed as the translated text. Warnings and detected languages (--src "
                                   "auto) go to stderr. A worker must be running (`nllb-worker run`). Exit "
                                   "status: 0 all ok, 1 some failed, 2 a mistake, 130 cancelled by Ctrl-C.")
    _job_args(p)
    p.add_argument("--url", default=None, help="AMQP URL of the broker; it may carry a password, which then "
                                              "shows in the process list (default: NLLB_AMQP_URL, "
                                              "amqp://guest:guest@127.0.0.1:5672/)")
    p.add_argument("--queue", default=None, help="jobs queue (default: NLLB_JOBS_QUEUE, nllb.jobs)")
    p.add_argument("--exchange", default=None, help="the workers' control exchange, where Ctrl-C sends the cancel "
                                                   "(default: NLLB_CONTROL_EXCHANGE, nllb.control)")
    p.add_argument("--timeout", type=positive_float, default=300.0,
                   help="seconds to wait for each reply; a job without one is printed as an error line "
                        "with code 'timeout' and the others go on (default: 300)")
    p.add_argument("--concurrency", type=positive_int, default=64, help="jobs in flight at once (default: 64)")
    p.add_argument("--document", default=None, metavar="FILE",
                   help="send FILE ('-' = stdin) as one document job and print its translation in the source's "
                        "layout; a progress bar of sentences on stderr from the worker's partial messages; "
                        "Ctrl-C cancels the job (default: none, one job a line)")
    p.add_argument("--json", action="store_true",
                   help="with --document, print the whole reply as JSON instead of the document; texts are "
                        "always printed as JSON replies (default: off)")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("translate", help="translate locally with the engine, no broker",
                       description="Translate on this machine: one output line per input line, or with "
                                   "--document a whole text in its own layout. Output warnings (repetition, "
                                   "length_ratio, off_target, truncated) go to stderr. Exit status: 0 done, "
                                   "2 a mistake.")
    _job_args(p)
    p.add_argument("--document", default=None, metavar="FILE",
                   help="translate FILE ('-' = stdin) as one document: split into sentences, each translated, "
                        "put back with the source's line breaks, blank lines and spaces; a progress bar of "
                        "sentences on stderr (default: none, one segment a line)")
    p.add_argument("--model", default=None, help="model directory (default: NLLB_MODEL, else the bundled "
                                                 "toy model)")
    p.add_argument("--adapters-dir", default=None, type=Path,
                   help="directory of LoRA adapters, one folder each (default: NLLB_ADAPTERS_DIR; unset: "
                        "none, or with the bundled toy model its adapters)")
    p.add_argument("--device", default=None, choices=["auto", "cuda", "cpu"],
                   help="engine device (default: NLLB_DEVICE, auto: cuda when a GPU is there)")
    p.add_argument("--batch", type=positive_int, default=32, help="segments per engine call (default: 32)")
    p.add_argument("--json", action="store_true",
                   help="JSON lines with source, text, tokens, score, warnings and (--src auto) detected_lang; "
                        "with --document one object with document, segments and usage (default: off, the "
                        "text only)")
    p.set_defaults(func=cmd_translate)

    add_cancel_command(sub)
