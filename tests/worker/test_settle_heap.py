"""The worker's collector settings (engine/heap.py settle_heap): what exists at start-up is out of the
collector's passes, the young generation is collected rarely, and cyclic garbage made afterwards is still
freed."""
from __future__ import annotations

import gc
import weakref

from engine.heap import GC_YOUNG_THRESHOLD, settle_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_settle_heap_freezes_what_exists_and_later_cycles_are_still_collected():
    threshold = gc.get_threshold()
    try:
        long_lived = [Node() for _ in range(10)]
        settle_heap()
        assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD
        assert gc.get_freeze_count() > len(long_lived)
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made after start-up
        gone = weakref.ref(a)
        del a, b
        assert gone() is not None  # refcounting alone cannot free it
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
