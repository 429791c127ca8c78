"""NLLB-200 inference engine: continuous batching over a fixed slot table (engine/engine.py, engine/step_loop.py)."""
from engine.engine import TOY_ADAPTERS_DIR, TOY_MODEL_DIR, Engine, EngineStats
from engine.errors import EngineError
from engine.jobs import JobFuture
from engine.options import DocumentTranslation, GenerationOptions, Hypothesis, SegmentResult, Translation, Usage

__all__ = ["Engine", "EngineStats", "EngineError", "GenerationOptions", "Hypothesis", "Translation",
           "DocumentTranslation", "SegmentResult", "Usage", "JobFuture", "TOY_ADAPTERS_DIR", "TOY_MODEL_DIR"]
