"""The collector settings of a process that serves the engine for long: the worker's processes call
`settle_heap` once everything they load is loaded, and so does the benchmark, which measures the engine as the
worker runs it.

A job's objects are freed by reference counting as it ends (engine/jobs.py Job.settle), so the collector's young
passes, every 700 net allocations by default, find little to free and scan everything in flight: ~0.55 s of every
5 s of single-sentence traffic in the toy model's worker on the 2-core machine, and a full pass over the process's
heap (~40 ms there; more in a process that also holds other models) every second. A pass every GC_YOUNG_THRESHOLD
net allocations still bounds what cycles there are (a few MB at most).
"""
from __future__ import annotations

import gc

GC_YOUNG_THRESHOLD = 50_000


def settle_heap() -> None:
    """What exists now (modules, models, the engine, settings) lives as long as the process: out of the collector's
    passes; and the young generation collected every GC_YOUNG_THRESHOLD net allocations."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD)
