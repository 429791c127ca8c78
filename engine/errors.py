"""Typed engine errors. Each carries the PROTOCOL.md error code the worker replies with.

The engine raises these for bad input (synchronously from `submit`/`translate`) and sets them
on a job's future when the job fails later (deadline, cancellation, engine failure). Messages name what was
asked, what is supported, and what to do instead.
"""
from __future__ import annotations


class EngineError(Exception):
    """Base class. `code` is the PROTOCOL.md error code; `retryable` tells producers to retry."""

    code = "internal"
    retryable = True


class InvalidRequest(EngineError):
    code = "invalid_request"
    retryable = False


class UnknownLanguage(EngineError):
    code = "unknown_language"
    retryable = False


class UnknownAdapter(EngineError):
    code = "unknown_adapter"
    retryable = False


class TooLong(EngineError):
    code = "too_long"
    retryable = False


class DeadlineExceeded(EngineError):
    code = "deadline_exceeded"
    retryable = False


class Cancelled(EngineError):
    """The job was cancelled (JobFuture.cancel, Engine.cancel) before it finished."""

    code = "cancelled"
    retryable = False


class Overloaded(EngineError):
    code = "overloaded"
    retryable = True


class EngineFailure(EngineError):
    """The engine itself failed (a bug, a device error) or is shutting down: retry elsewhere."""

    code = "internal"
    retryable = True


class CheckpointError(Exception):
    """A model directory is missing a file, holds a misshapen tensor, or is not M2M100/NLLB."""
