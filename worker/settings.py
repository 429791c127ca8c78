"""Worker settings: environment variables with the prefix NLLB_, or a `.env` file.

One source of truth: every default lives here. `.env.example` mirrors this file, one line per field.
Secrets (the AMQP URL carries a password) are SecretStr and never logged: use `Settings.safe_dump()`.
"""
from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, DotEnvSettingsSource, SettingsConfigDict

from engine.languages import AUTO, FLORES_CODES, close_matches
from kernels.limits import LORA_MAX_SLOTS

AMQP_NAME_MAX_BYTES = 255  # an AMQP short string: queue and exchange names
CONTROL_QUEUE_SUFFIX_BYTES = 17  # the control queue is named <control_exchange>.<16 hex digits> (worker/amqp.py)
AMQP_PREFETCH_MAX = 65535  # basic.qos's prefetch-count is a short
# The most rows the engine sizes its table to from memory (engine/engine.py, Engine._rows_from_memory); the default
# prefetch, twice the rows, then stays within AMQP_PREFETCH_MAX.
MAX_ROWS = 4096
MAX_CPU_THREADS = 1024
ENV_PREFIX = "NLLB_"


class SettingsFileError(ValueError):
    """The .env file cannot be read as settings (it is not UTF-8)."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_file=".env", env_file_encoding="utf-8", extra="ignore",
        validate_default=True, allow_inf_nan=False)  # no interval, timeout or threshold is infinite

    # --- the model and the engine -------------------------------------------------------------
    model: Path | None = Field(
        None, description="Model directory (config.json, safetensors, sentencepiece.bpe.model); "
                          "unset = the bundled toy model.")
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="Engine device: auto (cuda when a GPU is there), cuda, or cpu.")
    adapters_dir: Path | None = Field(
        None, description="Directory of LoRA adapters (one PEFT folder per adapter, named by "
                          "folder); unset = no adapters.")
    max_rows: int | None = Field(
        None, ge=1, le=MAX_ROWS, description="Slot-table rows (decoder hypotheses in flight), at most 4096; unset = "
                                             "sized by the engine: from free memory on a GPU (at most 4096), 64 to "
                                             "256 by the model's size on the CPU.")
    max_adapters: int | None = Field(
        None, ge=1, le=LORA_MAX_SLOTS - 1, description="Adapters resident at once (least recently used leave "
                                                       "first); unset = the engine's default.")
    max_lora_rank: int | None = Field(
        None, ge=1, le=64, description="Largest adapter rank served (higher ones are refused); the "
                                       "decoder's GEMMs widen with it times max_adapters; unset = 64.")
    cpu_threads: int | None = Field(
        None, ge=1, le=MAX_CPU_THREADS,
        description="Threads for torch's CPU operations (intra-op), at most 1024; unset = 1 for a small model "
                    "on the CPU (every weight under 2^18 elements, as the toy model's: its operations are too "
                    "small to share and idle threads spin), else torch's default, one per core.")

    # --- jobs ---------------------------------------------------------------------------------
    default_src_lang: str | None = Field(
        None, description="Source language for jobs that leave src_lang out (a worker dedicated "
                          "to one pair); unset = src_lang is required.")
    default_tgt_lang: str | None = Field(
        None, description="Target language for jobs that leave tgt_lang out; unset = required.")
    max_segments: int = Field(
        256, ge=1, description="Most segments (texts) one job may carry; more is answered too_long.")
    max_message_bytes: int = Field(
        8 * 2**20, ge=1, description="Largest job message body in bytes, checked before it is "
                                     "parsed; larger is answered too_long.")
    max_segment_chars: int = Field(
        50_000, ge=1, description="Most characters one segment may have, checked before it is "
                                  "tokenized; more is answered too_long (the source-token limit "
                                  "is checked after).")
    max_document_chars: int = Field(
        100_000, ge=1, description="Most characters one document may have, checked before it is "
                                   "split into sentences; more is answered too_long.")
    cancel_memory_s: float = Field(
        600.0, ge=0, description="Seconds a cancelled job id is remembered, so that a job arriving "
                                 "after its cancel is answered cancelled at once.")
    detect_threshold: float | None = Field(
        None, gt=0, le=1, description="Confidence under which src_lang auto is answered "
                                      "unknown_language; unset = the identifier's default.")
    output_warnings: bool = Field(
        True, description="Check each translation for repetition, length_ratio, off_target and "
                          "truncated and name them in the reply's warnings (off: no warnings, and "
                          "on_warning retry is answered invalid_request).")
    max_rows_per_job: int | None = Field(
        None, ge=1, description="Most slot-table rows one large job (a document) holds while a small "
                                "job is in the engine; unset = a quarter of the rows, at most 128.")
    warm_up: bool = Field(
        True, description="On a GPU, capture before consuming the CUDA graphs that sentences of up to 64 "
                          "source tokens take, greedy and beam 4, at every row count (a few seconds at "
                          "start), so that no job waits ~0.1 s for a capture (off: each is captured when "
                          "first needed).")
    list_adapters: bool = Field(
        False, description="unknown_adapter replies list the adapters this worker serves (off: "
                           "one tenant never learns another's adapter names).")

    # --- RabbitMQ -----------------------------------------------------------------------------
    amqp_url: SecretStr = Field(
        SecretStr("amqp://guest:guest@127.0.0.1:5672/"),
        description="AMQP URL of the broker (a secret: never logged; logs show it without password).")
    jobs_queue: str = Field("nllb.jobs", min_length=1,
                            description="Jobs queue (durable quorum queue) consumed by workers.")
    dead_letter_exchange: str = Field("nllb.dlx", min_length=1,
                                      description="Dead-letter exchange of the jobs queue (direct).")
    control_exchange: str = Field(
        "nllb.control", min_length=1,
        description="Control exchange (fanout, durable): cancels; each worker binds an exclusive "
                    "queue of its own to it, named after it plus 17 bytes (so at most 238 bytes).")
    dead_letter_queue: str = Field(
        "nllb.jobs.dead", min_length=1,
        description="Dead-letter queue (durable quorum), bound to the dead-letter exchange with "
                    "the jobs queue's name as routing key.")
    delivery_limit: int = Field(
        3, ge=1, description="x-delivery-limit of the jobs queue: a message returned more often "
                             "is dead-lettered (poison messages never loop).")
    prefetch: int | None = Field(
        None, ge=1, le=AMQP_PREFETCH_MAX,
        description="Unacknowledged jobs each broker process holds at once, at most 65535; unset = twice the "
                    "engine's slot-table rows (rows_total) shared among the broker processes, so that jobs "
                    "being parsed or answered don't leave rows idle.")
    broker_processes: int = Field(
        1, ge=1, le=64, description="Processes that talk to the broker, all feeding this worker's one "
                                    "engine: 1 = the engine's own process; more lift the few thousand jobs "
                                    "a second one event loop takes (a GPU engine answers more). Each has "
                                    "its own connection and, with a metrics port, HTTP endpoints on that "
                                    "port plus its index.")
    reconnect_interval_s: float = Field(
        1.0, gt=0, description="Seconds between reconnection attempts after the broker connection "
                               "is lost.")
    reply_refused_after_s: float = Field(
        30.0, gt=0, description="Seconds a reply the broker keeps refusing (nacks: its queue is full and "
                                "rejects publishes) is retried; then the job is dead-lettered instead of held.")
    drain_timeout_s: float = Field(
        60.0, ge=0, description="On SIGTERM/SIGINT: seconds to finish in-flight jobs before the "
                                "rest are requeued.")

    # --- operations ---------------------------------------------------------------------------
    metrics_port: int = Field(
        9464, ge=0, le=65535, description="HTTP port for /metrics, /healthz and /readyz "
                                          "(0 = no HTTP server).")
    metrics_host: str = Field("0.0.0.0", description="Address the HTTP server binds to.")
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="Log format: auto (JSON unless stdout is a terminal), json, console.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level: debug, info, warning, error.")

    def __init__(self, **values: Any) -> None:
        env_file = values.get("_env_file", self.model_config["env_file"])
        try:
            super().__init__(**values)
        except UnicodeDecodeError as e:
            raise SettingsFileError(f"{env_file}: not UTF-8 ({e.reason} at byte {e.start}); save it as UTF-8") from None

    @field_validator("log_level", "log_format", "device", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v

    @field_validator("model", "adapters_dir", "max_rows", "max_adapters", "max_lora_rank", "cpu_threads", "prefetch",
                     "default_src_lang", "default_tgt_lang", "detect_threshold", "max_rows_per_job", mode="before")
    @classmethod
    def _empty_is_none(cls, v: object) -> object:
        return None if isinstance(v, str) and v.strip() == "" else v

    @field_validator("default_src_lang", "default_tgt_lang")
    @classmethod
    def _language(cls, code: str | None, info: ValidationInfo) -> str | None:
        if code is None or code in FLORES_CODES or (code == AUTO and info.field_name == "default_src_lang"):
            return code
        if code == AUTO:
            raise ValueError("auto (identify the language) is for the source language only")
        matches = close_matches(code)
        hint = f"; did you mean {', '.join(map(repr, matches))}?" if matches else ""
        raise ValueError(f"not an NLLB-200 language code (FLORES-200 style, e.g. 'eng_Latn'){hint}")

    @field_validator("jobs_queue", "dead_letter_exchange", "dead_letter_queue", "control_exchange")
    @classmethod
    def _amqp_name(cls, name: str, info: ValidationInfo) -> str:
        limit = AMQP_NAME_MAX_BYTES
        if info.field_name == "control_exchange":  # its queue's name is this one's plus a suffix
            limit -= CONTROL_QUEUE_SUFFIX_BYTES
        if len(name.encode()) > limit:
            raise ValueError(f"{len(name.encode())} bytes; an AMQP name here has at most {limit}")
        return name

    @field_validator("amqp_url")
    @classmethod
    def _amqp_url(cls, url: SecretStr) -> SecretStr:
        try:
            parts = urlsplit(url.get_secret_value())
        except ValueError as e:  # an unclosed [IPv6 address]
            raise ValueError(f"not a URL: {e}") from None
        if parts.scheme not in ("amqp", "amqps"):
            raise ValueError("not an AMQP URL: amqp://user:password@host:port/vhost (or amqps://)")
        if not parts.hostname:
            raise ValueError("the URL names no host")
        try:
            port_ok = parts.port != 0  # None: the scheme's default port
        except ValueError:  # beyond 65535, or not a number
            port_ok = False
        if not port_ok:
            raise ValueError("the port is not a number in 1-65535")
        return url

    @model_validator(mode="after")
    def _metrics_ports(self) -> Settings:
        last = self.metrics_port + self.broker_processes - 1
        if self.metrics_port and last > 65535:
            raise ValueError(f"NLLB_METRICS_PORT: broker process {self.broker_processes - 1} would serve on "
                             f"NLLB_METRICS_PORT + {self.broker_processes - 1} = {last}, beyond port 65535")
        return self

    def amqp_url_redacted(self) -> str:
        """The AMQP URL with its password replaced by ***, safe to log."""
        return redact_url(self.amqp_url.get_secret_value())

    def safe_dump(self) -> dict[str, object]:
        """All settings as JSON-able values, secrets redacted: what the worker logs at start."""
        out = self.model_dump(mode="json")
        out["amqp_url"] = self.amqp_url_redacted()
        return out


def redact_url(url: str) -> str:
    """`url` with its password replaced by ***; a user part without a password (a token used as the user name,
    amqp://TOKEN@host) is replaced whole, and so is one that holds a / ? or # (a password the URL's parser would
    split elsewhere): what stands before the last @ is never shown but for a plain user name."""
    scheme, sep, rest = url.partition("://")
    if not sep:  # not a URL at all
        return "***" if "@" in url else url
    userinfo, at, host = rest.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    if not colon or any(c in userinfo for c in "/?#"):
        return f"{scheme}://***@{host}"
    return f"{scheme}://{user}:***@{host}"


def settings_error_line(error: ValidationError) -> str:
    """The first error of reading the settings, in one line: the NLLB_* variable, what is wrong and the value
    given (a URL without its password). A check across settings names them in its message."""
    err = error.errors()[0]
    problem = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
    if not err["loc"]:  # a model validator's: its input is every setting, secrets included
        return problem
    field = str(err["loc"][0])
    given = err.get("input")
    if Settings.model_fields[field].annotation is SecretStr:
        given = redact_url(str(given))
    return f"{ENV_PREFIX}{field.upper()}: {problem} (got {given!r})"


def unknown_settings(environ: Mapping[str, str]) -> list[str]:
    """Each NLLB_* variable of `environ` and of the .env file that names no setting, with the setting it may
    misspell: the worker ignores them, so a typo would otherwise go unseen. The .env file's other keys are left
    alone: a file shared with another tool (docker compose's) holds its own."""
    fields = [name.upper() for name in Settings.model_fields]
    found = [(name.upper(), "environment") for name in environ]
    found += [(name.upper(), ".env") for name in DotEnvSettingsSource(Settings).env_vars]
    unknown = []
    for name, where in found:
        field = name.removeprefix(ENV_PREFIX)
        if not name.startswith(ENV_PREFIX) or field in fields:
            continue
        close = difflib.get_close_matches(field, fields, n=1)
        unknown.append(f"{name} ({where})" + (f": did you mean {ENV_PREFIX}{close[0]}?" if close else ""))
    return unknown
