"""A plain aio-pika producer (deliberately not worker.client) and an in-process worker."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import uuid
from typing import Any

import aio_pika

from worker.metrics import Metrics
from worker.service import Service


class PlainProducer:
    """Publishes raw job bodies with a durable named reply queue; collects replies by id."""

    def __init__(self, url: str, jobs_queue: str, reply_queue: str) -> None:
        self.url, self.jobs_queue, self.reply_queue = url, jobs_queue, reply_queue
        self.replies: dict[str, list[dict[str, Any]]] = {}
        self.arrived = asyncio.Event()

    async def __aenter__(self) -> PlainProducer:
        self.conn = await aio_pika.connect_robust(self.url, reconnect_interval=0.5,
                                                  client_properties={"connection_name": "test-producer"})
        self.ch = await self.conn.channel(publisher_confirms=True)
        q = await self.ch.declare_queue(self.reply_queue, durable=True)
        await q.consume(self._on_reply)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.conn.close()

    async def _on_reply(self, m: aio_pika.abc.AbstractIncomingMessage) -> None:
        self.replies.setdefault(m.correlation_id or "", []).append(json.loads(m.body))
        self.arrived.set()
        await m.ack()

    async def publish(self, body: dict[str, Any] | bytes, *, cid: str | None = None,
                      reply: bool = True, **props: Any) -> str:
        cid = cid or uuid.uuid4().hex
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        props.setdefault("reply_to", self.reply_queue if reply else None)
        for attempt in range(100):
            try:
                await self.ch.default_exchange.publish(
                    aio_pika.Message(data, correlation_id=cid, content_type="application/json",
                                     delivery_mode=aio_pika.DeliveryMode.PERSISTENT, **props),
                    routing_key=self.jobs_queue, timeout=10)
                return cid
            except Exception:  # noqa: BLE001 - the broker is restarting in fault tests
                await asyncio.sleep(0.2)
        raise RuntimeError("could not publish")

    async def wait_for(self, cids: list[str] | set[str], timeout: float) -> None:
        """Until every id has at least one reply (TimeoutError otherwise)."""
        loop = asyncio.get_running_loop()
        t_end = loop.time() + timeout
        while not all(c in self.replies for c in cids):
            self.arrived.clear()
            left = t_end - loop.time()
            if left <= 0:
                missing = [c for c in cids if c not in self.replies]
                raise TimeoutError(f"{len(missing)} of {len(cids)} jobs unanswered")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.arrived.wait(), min(left, 1.0))

    async def dead_letters(self, queue: str, n: int, timeout: float) -> list[aio_pika.abc.AbstractIncomingMessage]:
        """The first `n` messages of the dead-letter queue `queue` (acked), or those that came within `timeout`."""
        ch = await self.conn.channel()
        dlq = await ch.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
        dead: list[aio_pika.abc.AbstractIncomingMessage] = []
        t_end = asyncio.get_running_loop().time() + timeout
        while len(dead) < n and asyncio.get_running_loop().time() < t_end:
            message = await dlq.get(fail=False)
            if message is None:
                await asyncio.sleep(0.1)
                continue
            dead.append(message)
            await message.ack()
        await ch.close()
        return dead

    async def one(self, body: dict[str, Any] | bytes, timeout: float = 60, **props: Any) -> dict[str, Any]:
        cid = await self.publish(body, **props)
        await self.wait_for([cid], timeout)
        return self.replies[cid][0]


@contextlib.asynccontextmanager
async def in_process_worker(settings: Any, engine: Any, **kw: Any):
    svc = Service(settings, engine, Metrics(), name="test-inproc", owns_engine=False, **kw)
    await svc.start()
    try:
        yield svc
    finally:
        svc.stop()
        await svc.shutdown()


def job(text: str | list[str], src: str = "eng_Latn", tgt: str = "fra_Latn", **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"v": 1, "id": uuid.uuid4().hex, "src_lang": src, "tgt_lang": tgt}
    body["texts" if isinstance(text, list) else "text"] = text
    body.update(kw)
    return body


async def _holds(value: Any) -> bool:
    return bool(await value) if inspect.isawaitable(value) else bool(value)


async def eventually(cond: Any, timeout: float = 10.0, what: str = "condition") -> None:
    """Wait until cond() is true; cond may return an awaitable (a blocking check run in a thread, so that the
    loop's connections keep being served while it waits)."""
    loop = asyncio.get_running_loop()
    t_end = loop.time() + timeout
    while not await _holds(cond()):
        if loop.time() > t_end:
            raise AssertionError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(0.05)
