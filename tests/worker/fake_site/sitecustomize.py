"""Test-only: with NLLB_TEST_FAKE_ENGINE set, `python -m worker run` gets the FakeEngine.

Used only while the real toy model is unavailable; the tests put this folder on PYTHONPATH."""
import os
import sys

if os.environ.get("NLLB_TEST_FAKE_ENGINE"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fake_engine import FakeEngine

    import engine

    def _load(*args, **kwargs):
        return FakeEngine(rows_total=int(kwargs.get("max_rows") or 16),
                          step_s=float(os.environ.get("NLLB_TEST_FAKE_STEP_S", "0.002")))

    engine.Engine.load = staticmethod(_load)
