"""Pydantic models of the wire protocol (docs/protocol.md, v1 with the 1.1 additions): the job
message body, the replies (final and `partial`), and the control messages (cancel).

Jobs are parsed strictly (unknown fields at the top level or in `options` are an error, so typos
never pass silently). Replies are parsed leniently by clients (`extra="ignore"`), because the
protocol only ever grows by optional fields.
"""
from __future__ import annotations

import dataclasses
import json
from collections import deque
from typing import Annotated, Any, Literal, Optional, get_type_hints

import orjson

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine.options import GenerationOptions

PROTOCOL_VERSION = 1
PROTOCOL_DOC = "docs/protocol.md"  # the producers' reference: what error messages point to
ERROR_CODES = ("invalid_request", "unknown_language", "unknown_adapter", "too_long",
               "deadline_exceeded", "cancelled", "overloaded", "internal")
RETRYABLE = {"overloaded": True, "internal": True}
MAX_ID_CHARS = 512
MAX_ECHO_CHARS = 100  # of a name a producer sent (a field, a language, an adapter) in an error


def clip(name: str) -> str:
    """A producer-supplied name as error messages echo it: at most MAX_ECHO_CHARS characters."""
    if len(name) <= MAX_ECHO_CHARS:
        return name
    return f"{name[:MAX_ECHO_CHARS]}... ({len(name)} characters)"


OnWarning = Literal["flag", "retry"]


def _integer_version(value: object) -> object:
    """`v` must be the integer 1: JSON's true and 1.0 equal 1 in Python, and Literal[1] would take them."""
    if type(value) is not int:
        raise PydanticCustomError("literal_error", "Input should be 1", {"expected": "1"})
    return value


#: the protocol version a message names: 1, or left out
Version = Annotated[Literal[1], BeforeValidator(_integer_version)]

#: Options the worker itself acts on or hands to the engine beside GenerationOptions.
WORKER_OPTIONS: dict[str, Any] = {"return_scores": (StrictBool, False),
                                  "return_tokens": (StrictBool, False),
                                  "return_segments": (StrictBool, False),  # documents
                                  "progress": (StrictBool, False),  # `partial` messages
                                  "on_warning": (OnWarning, "flag")}


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    def generation_fields(self) -> dict[str, Any]:
        """The engine's fields given, for `engine.GenerationOptions(**...)`."""
        return self.model_dump(exclude_none=True, exclude=set(WORKER_OPTIONS))


def _generation_options() -> dict[str, Any]:
    """Every field of engine.GenerationOptions, optional (None: the model's default); booleans
    strict, so `1` is not taken for `true`. Ranges are GenerationOptions' own checks."""
    hints = get_type_hints(GenerationOptions)
    return {f.name: (Optional[StrictBool if hints[f.name] is bool else hints[f.name]], None)
            for f in dataclasses.fields(GenerationOptions)}


#: `options` of a job: HF `generate` names, declared once (engine.GenerationOptions), then the
#: worker's own; an unknown name is an error.
JobOptions = create_model("JobOptions", __base__=_Options, **_generation_options(), **WORKER_OPTIONS)


class JobRequest(BaseModel):
    """A job message body (docs/protocol.md "Job message")."""

    model_config = ConfigDict(extra="forbid", strict=True)

    v: Version = PROTOCOL_VERSION
    id: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    src_lang: str | None = None
    tgt_lang: str | None = None
    text: str | None = None
    texts: list[str] | None = None
    document: str | None = None
    adapter: str | None = None
    deadline_ms: int | None = Field(None, ge=0, le=2**53)  # a float's exact integers
    options: JobOptions = Field(default_factory=JobOptions)

    @model_validator(mode="after")
    def _one_source(self) -> JobRequest:
        if sum(x is not None for x in (self.text, self.texts, self.document)) != 1:
            raise ValueError("give exactly one of 'text' (one segment), 'texts' (a list) or "
                             "'document' (a whole text)")
        if self.texts is not None and len(self.texts) == 0:
            raise ValueError("'texts' is empty; give at least one segment")
        return self

    @property
    def segments(self) -> list[str]:
        """The texts of a `text`/`texts` job ([] for a document)."""
        return [self.text] if self.text is not None else list(self.texts or [])


class BadJob(Exception):
    """A job body that is not JSON or does not match the schema. `job_id`: best effort."""

    def __init__(self, message: str, job_id: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id


def parse_job(body: bytes) -> JobRequest:
    """Parse and validate a job body; raise BadJob with a readable message naming the fault.
    orjson reads valid bodies (and refuses lone surrogates itself); a body it refuses is read again by
    the json module, whose messages (and the search for a lone surrogate) name the fault."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = _loads_describing_faults(body)
    else:
        if not isinstance(data, dict):
            raise BadJob(f"the body is JSON {type(data).__name__}, expected an object per {PROTOCOL_DOC}")
    job_id = data.get("id")
    if not isinstance(job_id, str) or not 0 < len(job_id) <= MAX_ID_CHARS:
        job_id = None  # not an id this worker can echo
    try:
        return JobRequest.model_validate(data)
    except ValidationError as e:
        raise BadJob(_describe(e), job_id) from None


def _loads_describing_faults(body: bytes) -> dict[str, Any]:
    """A body orjson refused: BadJob naming the fault, or the object when only orjson refuses it (a
    number beyond 64 bits, NaN: the schema judges those)."""
    try:
        data = json.loads(body.decode("utf-8"))
    except ValueError as e:  # not UTF-8, not JSON, or an integer over Python's 4,300 digits
        raise BadJob(f"the body is not UTF-8 JSON ({e}); send a JSON object per {PROTOCOL_DOC}") from None
    except RecursionError:
        raise BadJob(f"the body nests JSON too deeply; send a job object per {PROTOCOL_DOC}") from None
    if not isinstance(data, dict):
        raise BadJob(f"the body is JSON {type(data).__name__}, expected an object per {PROTOCOL_DOC}")
    unencodable = find_unencodable(data)
    if unencodable is not None:
        job_id = data.get("id")
        if not isinstance(job_id, str) or not 0 < len(job_id) <= MAX_ID_CHARS or unencodable == "'id'":
            job_id = None  # not an id this worker can echo
        raise BadJob(unencodable_message(unencodable), job_id)
    return data


def find_unencodable(data: dict[str, Any]) -> str | None:
    """Where the first string or field name is that UTF-8 cannot encode (`'texts[3]'`, `a field
    name in 'options'`): JSON's \\u escapes let a body carry lone surrogates, which Unicode does
    not allow."""
    queue: deque[tuple[str, Any]] = deque([("", data)])  # breadth first: the first bad segment
    while queue:
        path, value = queue.popleft()
        if isinstance(value, str) and not _encodable(value):
            return f"'{clip(path)}'"
        if isinstance(value, dict):
            for key, item in value.items():
                if not _encodable(key):
                    return f"a field name in '{clip(path)}'" if path else "a field name"
                queue.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            queue.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


def unencodable_message(where: str) -> str:
    return (f"{where} holds a lone surrogate (a \\uD800-\\uDFFF escape without its pair), which is "
            f"not Unicode and cannot be translated; send valid UTF-8 text")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _describe(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = clip(".".join(str(p) for p in err["loc"]) or "body")
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown field '{loc}' (see {PROTOCOL_DOC} for the accepted fields)")
        elif err["type"] == "literal_error" and loc == "v":
            parts.append(f"unsupported protocol version v={clip(repr(err.get('input')))}; "
                         f"this worker speaks v=1 (or leave v out)")
        elif err["type"] == "missing":
            parts.append(f"missing field '{loc}'")
        else:
            parts.append(f"{loc}: {err['msg']}")
    more = len(e.errors()) - 5
    return "invalid job: " + "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


# --- replies ------------------------------------------------------------------------------------

class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore")


class HypothesisOut(_Reply):
    text: str
    score: float | None = None
    tokens: list[int] | None = None


class TranslationOut(_Reply):
    text: str
    score: float | None = None
    tokens: list[int] | None = None
    hypotheses: list[HypothesisOut] | None = None
    warnings: list[str] | None = None  # engine.text.quality codes; left out when none
    retried: bool | None = None  # true: on_warning "retry" re-decoded it and kept the retry
    detected_lang: str | None = None  # src_lang "auto"
    detected_confidence: float | None = None


class SegmentOut(_Reply):
    """One sentence of a document (option return_segments)."""

    source: str
    text: str
    warnings: list[str] | None = None
    retried: bool | None = None


class Usage(_Reply):
    src_tokens: int
    tgt_tokens: int
    segments: int | None = None  # documents: sentences
    unique_segments: int | None = None  # documents: sentences decoded (a repeated one once)


class Timings(_Reply):
    queued: float
    compute: float


class OkReply(_Reply):
    v: Literal[1] = 1
    id: str | None
    status: Literal["ok"] = "ok"
    translations: list[TranslationOut] | None = None  # texts jobs
    document: str | None = None  # document jobs, instead of translations
    segments: list[SegmentOut] | None = None  # documents with option return_segments
    warnings: list[str] | None = None  # documents: the codes any of its sentences carries
    detected_lang: str | None = None  # documents with src_lang "auto"
    detected_confidence: float | None = None
    src_lang: str
    tgt_lang: str
    adapter: str | None = None
    model: str
    usage: Usage
    timings_ms: Timings


class ErrorInfo(_Reply):
    code: str
    message: str
    retryable: bool


class ErrorReply(_Reply):
    v: Literal[1] = 1
    id: str | None
    status: Literal["error"] = "error"
    error: ErrorInfo


class PartialSegment(_Reply):
    index: int  # position in `texts`, or the sentence's in the document
    text: str


class PartialReply(_Reply):
    """An interim message of a job with option progress: the segments finished since the last."""

    v: Literal[1] = 1
    id: str | None
    status: Literal["partial"] = "partial"
    done: int  # segments finished so far
    total: int  # segments of the job: its texts, or the document's sentences
    segments: list[PartialSegment]


Reply = OkReply | ErrorReply


class CancelRequest(BaseModel):
    """A control message on the control exchange. Unknown fields are ignored (later versions
    may add some); a body that is not this is logged and dropped."""

    model_config = ConfigDict(extra="ignore", strict=True)

    v: Version = PROTOCOL_VERSION
    cancel: str = Field(min_length=1, max_length=MAX_ID_CHARS)  # the job's id


def error_reply(job_id: str | None, code: str, message: str, retryable: bool | None = None) -> ErrorReply:
    if retryable is None:
        retryable = RETRYABLE.get(code, False)
    return ErrorReply(id=job_id, error=ErrorInfo(code=code, message=message, retryable=retryable))


def parse_reply(body: bytes) -> OkReply | ErrorReply | PartialReply:
    return reply_of(json.loads(body))


def reply_of(data: dict[str, Any]) -> OkReply | ErrorReply | PartialReply:
    """The reply a reply's JSON object is, by its status (ValidationError where it is not that reply)."""
    if data.get("status") == "ok":
        return OkReply.model_validate(data)
    if data.get("status") == "partial":
        return PartialReply.model_validate(data)
    return ErrorReply.model_validate(data)


def dump_reply(reply: OkReply | ErrorReply | PartialReply) -> bytes:
    """Reply JSON: fields that are None (not asked for) are left out, but for `id`, which every reply carries (null
    when the job had neither an id nor a message_id)."""
    fields = reply.model_dump(mode="json", exclude_none=True)
    return orjson.dumps({"v": fields.pop("v"), "id": reply.id, **fields})


def dump_body(reply: dict[str, Any]) -> bytes:
    """Reply JSON of a reply built as a plain dict (job.ok_reply): the same bytes as `dump_reply` of
    its model."""
    return orjson.dumps(reply)
