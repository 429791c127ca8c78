"""What the job commands of `nllb-worker` (`translate`, worker/cli.py; `submit`, worker/cli_submit.py) read from
the user and how they report back: argument types, the input segments or document, the languages, --options,
warnings. A user's mistake raises UsageError: `main` prints its message as one line and exits 2.
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Sequence
from typing import TextIO

from pydantic import ValidationError

from worker.messages import JobOptions
from worker.settings import Settings

AUTO = "auto"  # --src: identify the source language


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


def read_document(path: str) -> str:
    """The whole of --document (a path, or '-' for stdin) exactly as it is: line endings included."""
    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as e:
        raise UsageError(f"--document {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--document {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def is_blank(segment: str) -> bool:
    return not segment.strip()


def warn(where: str, codes: Sequence[str] | None) -> None:
    """Output warnings (docs/protocol.md, Warnings) on stderr, one line per segment that has some."""
    if codes:
        print(f"warning: {where}: {', '.join(codes)}", file=sys.stderr)


def excerpt(text: str, chars: int = 40) -> str:
    flat = " ".join(text.split())
    return json.dumps(flat if len(flat) <= chars else flat[:chars] + "...", ensure_ascii=False)


def languages(args: argparse.Namespace, settings: Settings) -> tuple[str, str]:
    """--src/--tgt (defaults NLLB_DEFAULT_SRC_LANG/NLLB_DEFAULT_TGT_LANG), checked against NLLB-200's codes;
    --src may be `auto` (the language is identified)."""
    from engine.errors import UnknownLanguage
    from engine.languages import check_language
    out = []
    for flag, given, default in (("--src", args.src, settings.default_src_lang),
                                 ("--tgt", args.tgt, settings.default_tgt_lang)):
        code = given or default
        if not code:
            raise UsageError(f"{flag} is required (e.g. {flag} eng_Latn{' or --src auto' * (flag == '--src')}), "
                             f"or set NLLB_DEFAULT_{flag[2:].upper()}_LANG")
        if flag == "--src" and code == AUTO:
            out.append(code)
            continue
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
