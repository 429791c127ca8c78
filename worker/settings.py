"""Worker settings: environment variables with the prefix NLLB_, or a `.env` file.

One source of truth: every default lives here. `.env.example` mirrors this file, one line per field.
Secrets (the AMQP URL carries a password) are SecretStr and never logged: use `Settings.safe_dump()`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kernels.limits import LORA_MAX_SLOTS


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="NLLB_", env_file=".env", env_file_encoding="utf-8", extra="ignore",
        validate_default=True)

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
        None, ge=1, description="Slot-table rows (decoder hypotheses in flight); unset = sized by the "
                                "engine: from free memory on a GPU, 64 to 256 by the model's size on the CPU.")
    max_adapters: int | None = Field(
        None, ge=1, le=LORA_MAX_SLOTS - 1, description="Adapters resident at once (least recently used leave "
                                                       "first); unset = the engine's default.")
    max_lora_rank: int | None = Field(
        None, ge=1, le=64, description="Largest adapter rank served (higher ones are refused); the "
                                       "decoder's GEMMs widen with it times max_adapters; unset = 64.")
    cpu_threads: int | None = Field(
        None, ge=1, description="Threads for torch's CPU operations (intra-op); unset = 1 for a small model "
                                "on the CPU (every weight under 2^18 elements, as the toy model's: its "
                                "operations are too small to share and idle threads spin), else torch's "
                                "default, one per core.")

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
                    "queue of its own to it.")
    dead_letter_queue: str = Field(
        "nllb.jobs.dead", min_length=1,
        description="Dead-letter queue (durable quorum), bound to the dead-letter exchange with "
                    "the jobs queue's name as routing key.")
    delivery_limit: int = Field(
        3, ge=1, description="x-delivery-limit of the jobs queue: a message returned more often "
                             "is dead-lettered (poison messages never loop).")
    prefetch: int | None = Field(
        None, ge=1, description="Unacknowledged jobs each broker process holds at once; unset = twice the "
                                "engine's slot-table rows (rows_total) shared among the broker processes, "
                                "so that jobs being parsed or answered don't leave rows idle.")
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

    @field_validator("log_level", "log_format", "device", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v

    @field_validator("model", "adapters_dir", "max_rows", "max_adapters", "max_lora_rank", "cpu_threads", "prefetch",
                     "default_src_lang", "default_tgt_lang", "detect_threshold", "max_rows_per_job", mode="before")
    @classmethod
    def _empty_is_none(cls, v: object) -> object:
        return None if isinstance(v, str) and v.strip() == "" else v

    def amqp_url_redacted(self) -> str:
        """The AMQP URL with its password replaced by ***, safe to log."""
        return redact_url(self.amqp_url.get_secret_value())

    def safe_dump(self) -> dict[str, object]:
        """All settings as JSON-able values, secrets redacted: what the worker logs at start."""
        out = self.model_dump(mode="json")
        out["amqp_url"] = self.amqp_url_redacted()
        return out


def redact_url(url: str) -> str:
    """`url` with its password replaced by ***; a user part without a password (a token used as
    the user name, amqp://TOKEN@host) is replaced whole."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = "***" if parts.password is None else f"{parts.username or ''}:***"
    return urlunsplit((parts.scheme, f"{user}@{host}", parts.path, parts.query, parts.fragment))
