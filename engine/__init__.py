"""NLLB-200 inference engine: continuous batching over a fixed slot table (see engine/engine.py)."""
from engine.engine import TOY_ADAPTERS_DIR, TOY_MODEL_DIR, Engine, EngineStats
from engine.errors import EngineError
from engine.options import GenerationOptions, Hypothesis, Translation
from engine.scheduler import JobFuture

__all__ = ["Engine", "EngineStats", "EngineError", "GenerationOptions", "Hypothesis", "Translation",
           "JobFuture", "TOY_ADAPTERS_DIR", "TOY_MODEL_DIR"]
