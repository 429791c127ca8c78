"""One job from delivery to reply, as steps that know nothing of the broker or the event loop:

    parse(Received) -> JobRequest        the body, strictly (docs/protocol.md "Job message")
    check(JobRequest, Received) -> Job   what the worker owns: deadline on receipt, languages
                                         present, segment count and sizes, options
    (run: Service._run, the engine)      -> Ran: translations (or a document) and timings
    ok_reply(Job, Ran) -> dict           the reply body (texts_reply / document_reply)

A step that cannot go on raises `Refused` (answered with an error reply) or `Unanswerable`
(dead-lettered); `Service` turns those into outcomes of the decision table (`worker.outcomes`).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from engine import GenerationOptions, Translation
from engine.errors import EngineError, InvalidRequest
from engine.options import DocumentTranslation
from worker.messages import (
    MAX_ECHO_CHARS,
    PROTOCOL_VERSION,
    BadJob,
    ErrorReply,
    JobRequest,
    clip,
    error_reply,
    parse_job,
)
from worker.settings import Settings


@dataclass(frozen=True)
class Received:
    """What the worker reads of one delivery."""

    body: bytes
    reply_to: str | None
    message_id: str | None
    received_at: float  # epoch seconds


class Refused(Exception):
    """Answer the job with this error instead of a translation."""

    def __init__(self, code: str, message: str, retryable: bool | None = None,
                 job_id: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retryable, self.job_id = code, message, retryable, job_id

    def reply(self, job_id: str | None) -> ErrorReply:
        return error_reply(self.job_id or job_id, self.code, self.message, self.retryable)


class Unanswerable(Exception):
    """No reply_to: nowhere to answer, so the job goes to the dead-letter queue."""


@dataclass(frozen=True)
class Job:
    """A checked job, ready for the engine."""

    id: str | None
    request: JobRequest
    segments: list[str]  # texts ([] for a document)
    document: str | None
    src_lang: str  # a FLORES code, or "auto"
    tgt_lang: str
    options: GenerationOptions | None
    deadline: float | None  # epoch seconds


@dataclass(frozen=True)
class Ran:
    """The engine's answer to a job and how long it waited and worked."""

    answer: list[Translation] | DocumentTranslation  # one per text, or the document
    queued_s: float   # receipt to taking rows
    compute_s: float  # taking rows to the last segment's result


def parse(received: Received, max_bytes: int) -> JobRequest:
    """The job body, parsed strictly. Unanswerable without reply_to; Refused when larger than
    `max_bytes` (before any parsing) or malformed."""
    if received.reply_to is None:
        raise Unanswerable("no reply_to")
    if len(received.body) > max_bytes:
        raise Refused("too_long", f"the message is {len(received.body):,} bytes; this worker takes "
                      f"at most {max_bytes:,} (NLLB_MAX_MESSAGE_BYTES); split it into several jobs")
    try:
        return parse_job(received.body)
    except BadJob as e:
        raise Refused("invalid_request", str(e), job_id=e.job_id) from None


def check(req: JobRequest, received: Received, settings: Settings) -> Job:
    """What the worker checks before the engine sees the job; Refused naming the fault."""
    job_id = req.id or received.message_id
    if req.deadline_ms is not None and received.received_at * 1000 >= req.deadline_ms:
        late = received.received_at * 1000 - req.deadline_ms
        raise Refused("deadline_exceeded", f"deadline_ms={req.deadline_ms} passed {late:.0f} ms "
                      f"before the job was received; send a later deadline or none", job_id=job_id)
    # a language the job gives, even "", is its own: the engine refuses one it does not know
    src = req.src_lang if req.src_lang is not None else settings.default_src_lang
    tgt = req.tgt_lang if req.tgt_lang is not None else settings.default_tgt_lang
    if src is None or tgt is None:
        missing = "src_lang" if src is None else "tgt_lang"
        raise Refused("invalid_request", f"missing field '{missing}' and this worker has no default "
                      f"(NLLB_DEFAULT_{missing.upper()}); give it in the job", job_id=job_id)
    segments = req.segments
    if req.document is not None and len(req.document) > settings.max_document_chars:
        raise Refused("too_long", f"the document has {len(req.document):,} characters; this worker "
                      f"takes at most {settings.max_document_chars:,} (NLLB_MAX_DOCUMENT_CHARS); split "
                      f"it into several documents", job_id=job_id)
    if len(segments) > settings.max_segments:
        raise Refused("too_long", f"the job has {len(segments)} segments; this worker takes at most "
                      f"{settings.max_segments} (NLLB_MAX_SEGMENTS); split it into several jobs",
                      job_id=job_id)
    for i, segment in enumerate(segments):
        if len(segment) > settings.max_segment_chars:
            raise Refused("too_long", f"segment {i} has {len(segment):,} characters; this worker "
                          f"takes at most {settings.max_segment_chars:,} a segment "
                          f"(NLLB_MAX_SEGMENT_CHARS); split the text into shorter segments",
                          job_id=job_id)
    try:
        options = generation_options(req.options.generation_fields())
    except InvalidRequest as e:
        raise Refused("invalid_request", str(e), job_id=job_id) from None
    deadline = req.deadline_ms / 1000 if req.deadline_ms is not None else None
    return Job(job_id, req, segments, req.document, src, tgt, options, deadline)


#: GenerationOptions (frozen) by the fields a job gave, as (name, type, value): producers send a few option sets
#: over and over, and making and checking one took ~8 us of the loop a job on the 2-core machine
_OPTIONS: dict[tuple[tuple[str, type, Any], ...], GenerationOptions] = {}
OPTIONS_CACHED = 1024  # distinct option sets kept; the cache starts again when full


def generation_options(fields: dict[str, Any]) -> GenerationOptions | None:
    """The engine's options for these fields (None when none is given); InvalidRequest naming a bad value."""
    if not fields:
        return None
    key = tuple((name, type(value), value) for name, value in fields.items())
    options = _OPTIONS.get(key)
    if options is None:
        options = GenerationOptions(**fields)  # raises before anything is kept
        if len(_OPTIONS) >= OPTIONS_CACHED:
            _OPTIONS.clear()
        _OPTIONS[key] = options
    return options


def engine_refusal(error: EngineError, job: Job, settings: Settings) -> Refused:
    """What the engine refused, as the producer is told: names the producer sent echoed at most
    MAX_ECHO_CHARS long; for adapters, no server path, and the adapters served only when
    NLLB_LIST_ADAPTERS allows it."""
    message = str(error)
    for name in (job.src_lang, job.tgt_lang, job.request.adapter):
        if name and len(name) > MAX_ECHO_CHARS:
            message = message.replace(name, clip(name))
    if error.code == "unknown_adapter":
        message = _PATH.sub("<adapters>", message)
        if settings.list_adapters:
            message += f"; this worker serves: {', '.join(served_adapters(settings)) or 'none'}"
    return Refused(error.code, message, error.retryable, job.id)


#: an absolute path in a message: a '/' after a space, quote or '(' up to the next such delimiter
_PATH = re.compile(r"(?<=[\s'\"(])/[^\s'\")]*")


def served_adapters(settings: Settings) -> list[str]:
    folder = settings.adapters_dir
    if folder is None or not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if (p / "adapter_config.json").is_file())


def ok_reply(job: Job, ran: Ran, model: str) -> dict[str, Any]:
    """The success reply as the wire carries it: translations of texts, or the document, with what was
    asked for. A plain dict in the field order of `messages.OkReply`, fields that are None left out
    (what `dump_reply` of the model gives; the tests hold it to the model): no model objects per job."""
    tail = {"src_lang": job.src_lang, "tgt_lang": job.tgt_lang, "adapter": job.request.adapter, "model": model}
    timings = {"queued": round(ran.queued_s * 1e3, 3), "compute": round(ran.compute_s * 1e3, 3)}
    if isinstance(ran.answer, DocumentTranslation):
        body, usage = document_reply(job, ran.answer)
    else:
        body, usage = texts_reply(job, ran.answer)
    # the id is there even when null (a job with neither an id nor a message_id), as in every reply
    return {"v": PROTOCOL_VERSION, "id": job.id, "status": "ok",
            **_present({**body, **tail, "usage": usage, "timings_ms": timings})}


def texts_reply(job: Job, translations: list[Translation]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Best hypothesis per text, n best, scores and tokens as asked; warnings, retried and the
    detected language where there are some. (the reply's fields, its usage)"""
    want_scores, want_tokens = job.request.options.return_scores, job.request.options.return_tokens
    out = []
    for t in translations:
        hyps = None
        if len(t.hypotheses or []) > 1:
            hyps = [_hypothesis(h.text, h.score, h.tokens, want_scores, want_tokens) for h in t.hypotheses]
        item = _hypothesis(t.text, t.score, t.tokens, want_scores, want_tokens)
        item.update(_present({"hypotheses": hyps, "warnings": list(t.warnings) or None,
                              "retried": t.retried or None, "detected_lang": t.detected_lang,
                              "detected_confidence": _confidence(t.detected_confidence)}))
        out.append(item)
    usage = {"src_tokens": sum(int(t.src_tokens) for t in translations),
             "tgt_tokens": sum(len(t.tokens) for t in translations)}
    return {"translations": out}, usage


def _hypothesis(text: str, score: float, tokens: list[int], want_scores: bool, want_tokens: bool) -> dict[str, Any]:
    item: dict[str, Any] = {"text": text}
    if want_scores:
        item["score"] = float(score)
    if want_tokens:
        item["tokens"] = [int(t) for t in tokens]
    return item


def document_reply(job: Job, doc: DocumentTranslation) -> tuple[dict[str, Any], dict[str, Any]]:
    """The document in its layout; its sentences with return_segments; the warnings any sentence
    carries; usage counts the sentences decoded (a repeated one once). (the reply's fields, its usage)"""
    segments = None
    if job.request.options.return_segments:
        segments = [_present({"source": s.source, "text": s.translation.text,
                              "warnings": list(s.translation.warnings) or None,
                              "retried": s.translation.retried or None}) for s in doc.segments]
    warnings = sorted({w for s in doc.segments for w in s.translation.warnings})
    u = doc.usage
    usage = {"src_tokens": u.src_tokens, "tgt_tokens": u.tgt_tokens, "segments": u.segments,
             "unique_segments": u.unique_segments}
    return {"document": doc.text, "segments": segments, "warnings": warnings or None,
            "detected_lang": doc.detected_lang,
            "detected_confidence": _confidence(doc.detected_confidence)}, usage


def _present(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields that are not None: the wire leaves out what was not asked for."""
    return {k: v for k, v in fields.items() if v is not None}


def _confidence(value: float | None) -> float | None:
    return None if value is None else round(float(value), 4)


def monotonic_of(t_wall: float) -> float:
    """A wall-clock instant on the monotonic clock (for spans that start at receipt)."""
    return time.monotonic() - (time.time() - t_wall)
