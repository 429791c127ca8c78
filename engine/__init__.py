"""NLLB-200 inference engine: continuous batching over a fixed slot table (engine/engine.py, engine/step_loop.py).

`Engine` and the bundled toy model's paths are imported when first asked for: they bring torch, which the
worker's broker processes (worker/processes.py) never load; the rest here is plain Python.
"""
from __future__ import annotations

from typing import Any

from engine.errors import EngineError
from engine.options import (DocumentTranslation, EngineStats, GenerationOptions, Hypothesis, JobFuture, SegmentResult,
                            Translation, Usage)

__all__ = ["Engine", "EngineStats", "EngineError", "GenerationOptions", "Hypothesis", "Translation",
           "DocumentTranslation", "SegmentResult", "Usage", "JobFuture", "TOY_ADAPTERS_DIR", "TOY_MODEL_DIR"]
_WITH_TORCH = ("Engine", "TOY_ADAPTERS_DIR", "TOY_MODEL_DIR")


def __getattr__(name: str) -> Any:
    if name in _WITH_TORCH:
        from engine import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
