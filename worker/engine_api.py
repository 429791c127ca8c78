"""What the worker uses of the engine: a Protocol, so the worker holds a typed engine, never `Any`.

`engine.Engine` satisfies it; tests wrap it (to inject failures) and satisfy it the same way. The
worker calls it only through `Service` (submit, stats, is_alive, close on the event loop's side;
`submit` and `submit_document` on a worker thread, since they tokenize).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from engine import EngineStats, GenerationOptions, JobFuture, Translation

OnWarning = Literal["flag", "retry"]
OnSegment = Callable[[int, Translation], None]


class EngineAPI(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def rows_total(self) -> int: ...

    def submit(self, texts: Sequence[str], src_lang: str, tgt_lang: str,
               options: GenerationOptions | None = None, adapter: str | None = None,
               deadline: float | None = None, on_warning: OnWarning = "flag",
               job_id: str | None = None, on_segment: OnSegment | None = None) -> JobFuture:
        """Queue a job; the future resolves to list[Translation], one per text, in order.
        Bad input raises here (engine.errors: InvalidRequest, UnknownLanguage, UnknownAdapter,
        TooLong); EngineFailure when the engine cannot take jobs."""
        ...

    def submit_document(self, doc: str, src_lang: str, tgt_lang: str,
                        options: GenerationOptions | None = None, adapter: str | None = None,
                        deadline: float | None = None, on_warning: OnWarning = "flag",
                        job_id: str | None = None, on_segment: OnSegment | None = None,
                        max_chars: int = 100_000) -> JobFuture:
        """Queue one document; the future resolves to a DocumentTranslation."""
        ...

    def cancel(self, job_id: str) -> bool:
        """Free a job's rows (at the next step); its future raises Cancelled. False: unknown id."""
        ...

    def stats(self) -> EngineStats: ...

    def is_alive(self) -> bool: ...

    def close(self) -> None: ...


class ServedEngine(EngineAPI, Protocol):
    """The engine as the engine's process serves it to broker processes (worker/engine_link.py)."""

    def post(self, fn: Callable[[], object]) -> None:
        """Run fn() on the engine thread between steps, without waiting (engine.Engine.post)."""
        ...
