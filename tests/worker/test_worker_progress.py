"""Partial messages: a segment that finishes before the engine said how many there are waits for it."""
from __future__ import annotations

import asyncio

import orjson

from engine import Translation
from worker.progress import Progress


def test_segments_finished_before_the_total_is_known_wait_for_it():
    async def body() -> list[dict]:
        sent: list[dict] = []

        async def send(message: bytes) -> None:
            sent.append(orjson.loads(message))
        progress = Progress("doc-1", send, interval_s=0.05)
        progress.on_segment(2, Translation("zwei", [7], 0.0))  # from the engine, before submit returned
        await asyncio.sleep(0.1)
        assert sent == []
        progress.start(3)
        await asyncio.sleep(0.1)
        await progress.close()
        return sent
    sent = asyncio.run(body())
    assert sent == [{"v": 1, "id": "doc-1", "status": "partial", "done": 1, "total": 3,
                     "segments": [{"index": 2, "text": "zwei"}]}]
