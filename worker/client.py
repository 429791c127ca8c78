"""The producer side of PROTOCOL.md: publish jobs, await replies by correlation id.

    async with NllbClient(url) as client:
        reply = await client.translate(["Hello."], "eng_Latn", "fra_Latn", timeout=30)

Replies arrive on one reply queue per client: by default an exclusive, server-named queue;
pass `reply_queue="name"` for a durable named queue that outlives connection drops (the caller
deletes it). Delivery is at least once: a job may be answered twice; the second reply is dropped
and counted in `duplicates`. Replies to jobs nobody waits for any more (timed out) count as `late`.
Interim `partial` messages of a job go to its `on_progress` callback, or are dropped without one: a
job's future is only ever resolved by its final reply, which always comes last. `cancel(job_id)`
asks the workers to drop a job (docs/protocol.md).
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import uuid
from collections.abc import Callable
from typing import Any

import aio_pika
from aio_pika.abc import AbstractIncomingMessage
from aio_pika.exceptions import ChannelNotFoundEntity, DeliveryError, PublishError

from worker.amqp import CONNECTION_ERRORS
from worker.messages import ErrorReply, OkReply, parse_reply


class ClientError(Exception):
    pass


class JobNotRouted(ClientError):
    """The jobs queue does not exist (the broker returned the job): start a worker first."""

    code = "not_routed"


class QueueFull(ClientError):
    """The broker refused the job (x-overflow=reject-publish: the queue is at its length limit).
    Retryable: back off and publish again."""

    code = "overloaded"


CONTROL_EXCHANGE = "nllb.control"  # fanout: cancels reach every worker

OnProgress = Callable[[dict[str, Any]], None]  # a `partial` message's JSON object


class NllbClient:
    def __init__(self, url: str = "amqp://guest:guest@127.0.0.1:5672/",
                 jobs_queue: str = "nllb.jobs", reply_queue: str | None = None,
                 name: str = "nllb-client", reconnect_interval: float = 1.0,
                 control_exchange: str = CONTROL_EXCHANGE) -> None:
        self.url = url
        self.jobs_queue = jobs_queue
        self.control_exchange = control_exchange
        self.reply_queue_name = reply_queue
        self.name = name
        self.reconnect_interval = reconnect_interval
        self.connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._channel: aio_pika.abc.AbstractRobustChannel | None = None
        self._reply_queue: aio_pika.abc.AbstractRobustQueue | None = None
        self._pending: dict[str, asyncio.Future] = {}
        self._progress: dict[str, OnProgress] = {}
        self._answered: set[str] = set()
        self.duplicates = 0
        self.late = 0
        self.replies = 0

    async def __aenter__(self) -> NllbClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def reply_to(self) -> str:
        assert self._reply_queue is not None
        return self._reply_queue.name

    async def connect(self) -> None:
        self.connection = await aio_pika.connect_robust(
            self.url, reconnect_interval=self.reconnect_interval,
            client_properties={"connection_name": self.name})
        self._channel = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
        if self.reply_queue_name:
            self._reply_queue = await self._channel.declare_queue(self.reply_queue_name, durable=True)
        else:
            self._reply_queue = await self._channel.declare_queue(exclusive=True, auto_delete=True)
        await self._reply_queue.consume(self._on_reply)

    async def consumer_count(self) -> int:
        """Workers consuming the jobs queue now (a passive declare: nothing is created).
        JobNotRouted when the queue does not exist."""
        assert self.connection is not None
        channel = await self.connection.channel()  # a failed passive declare closes its channel
        try:
            queue = await channel.declare_queue(self.jobs_queue, passive=True)
        except ChannelNotFoundEntity:
            raise JobNotRouted(self._no_queue()) from None
        count = queue.declaration_result.consumer_count
        await channel.close()
        return count

    def _no_queue(self) -> str:
        return f"queue {self.jobs_queue!r} does not exist: start a worker with `nllb-worker run`"

    async def close(self) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.cancel()
        if self.connection is not None:
            await self.connection.close()

    async def cancel(self, job_id: str) -> None:
        """Publish a cancel for `job_id` to the control exchange (confirmed). The worker holding the job
        frees its rows and answers it `cancelled`; an unknown or finished id is ignored. JobNotRouted
        when the exchange does not exist (no worker has declared it)."""
        assert self.connection is not None
        channel = await self.connection.channel(publisher_confirms=True)
        try:
            exchange = await channel.get_exchange(self.control_exchange, ensure=True)  # passive
        except ChannelNotFoundEntity:
            raise JobNotRouted(f"exchange {self.control_exchange!r} does not exist: start a worker with "
                               "`nllb-worker run`") from None
        body = json.dumps({"v": 1, "cancel": job_id}).encode()
        await exchange.publish(aio_pika.Message(body, content_type="application/json"), routing_key="",
                               timeout=30)
        await channel.close()

    async def _on_reply(self, message: AbstractIncomingMessage) -> None:
        cid = message.correlation_id
        if _is_partial(message.body):  # never the final reply, whether or not someone asked for it
            if cid in self._progress:
                with contextlib.suppress(Exception):  # a caller's callback must not stop the replies
                    self._progress[cid](json.loads(message.body))
            await message.ack()
            return
        try:
            reply = parse_reply(message.body)
        except Exception:  # noqa: BLE001 - not ours to judge: count as late
            reply = None
        fut = self._pending.get(cid) if cid else None
        if fut is not None and not fut.done():
            self.replies += 1
            self._answered.add(cid)
            fut.set_result(reply)
        elif cid in self._answered:
            self.duplicates += 1
        else:
            self.late += 1
        await message.ack()

    async def publish(self, body: dict[str, Any] | bytes, *, correlation_id: str | None = None,
                      message_id: str | None = None, expiration_ms: int | None = None,
                      timeout: float = 60.0, on_progress: OnProgress | None = None) -> asyncio.Future:
        """Publish one job (persistent, confirmed, mandatory); return the future of its final reply.
        `on_progress` gets each `partial` message of the job (option "progress": true)."""
        assert self._channel is not None
        cid = correlation_id or uuid.uuid4().hex
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        fut = asyncio.get_running_loop().create_future()
        self._pending[cid] = fut
        if on_progress is not None:
            self._progress[cid] = on_progress
            fut.add_done_callback(lambda _: self._progress.pop(cid, None))
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        while True:
            msg = aio_pika.Message(
                data, content_type="application/json", correlation_id=cid,
                message_id=message_id or cid, reply_to=self.reply_to,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                timestamp=dt.datetime.now(dt.timezone.utc),
                expiration=dt.timedelta(milliseconds=expiration_ms) if expiration_ms else None)
            try:
                await self._channel.default_exchange.publish(msg, routing_key=self.jobs_queue,
                                                             mandatory=True, timeout=30)
                return fut
            except PublishError:
                self._pending.pop(cid, None)
                raise JobNotRouted(self._no_queue()) from None
            except DeliveryError:
                self._pending.pop(cid, None)
                raise QueueFull(f"the broker refused the job: queue {self.jobs_queue!r} is full; "
                                f"retry later") from None
            except CONNECTION_ERRORS:
                if loop.time() > give_up:
                    self._pending.pop(cid, None)
                    raise
                await asyncio.sleep(0.2)

    async def wait(self, fut: asyncio.Future, timeout: float | None) -> OkReply | ErrorReply:
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        finally:
            if fut.done() or timeout is not None:
                for cid, f in list(self._pending.items()):
                    if f is fut:
                        del self._pending[cid]
                        self._progress.pop(cid, None)

    async def translate(self, texts: list[str] | str, src_lang: str | None = None,
                        tgt_lang: str | None = None, *, adapter: str | None = None,
                        options: dict[str, Any] | None = None, deadline_ms: int | None = None,
                        job_id: str | None = None, timeout: float | None = 60.0
                        ) -> OkReply | ErrorReply:
        """Publish one job and wait for its reply (asyncio.TimeoutError after `timeout`)."""
        fut = await self.publish(self.job_body(texts, src_lang, tgt_lang, adapter=adapter,
                                               options=options, deadline_ms=deadline_ms,
                                               job_id=job_id))
        return await self.wait(fut, timeout)

    @staticmethod
    def job_body(texts: list[str] | str | None, src_lang: str | None = None, tgt_lang: str | None = None,
                 *, document: str | None = None, adapter: str | None = None,
                 options: dict[str, Any] | None = None, deadline_ms: int | None = None,
                 job_id: str | None = None) -> dict[str, Any]:
        """A job's body: `texts` (a list, or one string), or else a whole `document`."""
        if (texts is None) == (document is None):
            raise ValueError("give texts or a document, one of the two")
        body: dict[str, Any] = {"v": 1, "id": job_id or uuid.uuid4().hex}
        if document is not None:
            body["document"] = document
        elif isinstance(texts, str):
            body["text"] = texts
        else:
            body["texts"] = list(texts)
        for k, v in (("src_lang", src_lang), ("tgt_lang", tgt_lang), ("adapter", adapter),
                     ("deadline_ms", deadline_ms), ("options", options)):
            if v is not None:
                body[k] = v
        return body


def _is_partial(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("status") == "partial"
