"""RabbitMQ plumbing: robust connection, the topology of PROTOCOL.md, consume, confirmed publish.

The topology is declared at start, exactly (another file, deploy/rabbitmq/definitions.json, must
match it; a mismatch fails loudly with PRECONDITION_FAILED instead of silently running with other
guarantees):

- exchange `<dead_letter_exchange>`: direct, durable;
- queue `<dead_letter_queue>`: durable quorum, no other arguments, bound to the exchange with
  routing key `<jobs_queue>`;
- queue `<jobs_queue>`: durable, arguments `jobs_queue_arguments(settings)`.

Two channels: one consumes (QoS = prefetch), one publishes replies in confirm mode with
mandatory=True, so a reply to a queue that is gone comes back as *returned*, not silently lost.
"""
from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
import aiormq
import structlog
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection
from aio_pika.exceptions import ChannelInvalidStateError, DeliveryError, MessageProcessError, PublishError

from worker.metrics import Metrics
from worker.settings import Settings

log = structlog.get_logger("worker.amqp")

#: What can go wrong on the wire while the robust connection is (re)connecting.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    ChannelInvalidStateError, aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelClosed, aiormq.exceptions.ConnectionClosed, ConnectionError,
    asyncio.TimeoutError, RuntimeError,
)


def jobs_queue_arguments(settings: Settings) -> dict[str, Any]:
    return {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": settings.dead_letter_exchange,
        "x-delivery-limit": settings.delivery_limit,
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }


async def declare_topology(channel: aio_pika.abc.AbstractChannel, settings: Settings
                           ) -> aio_pika.abc.AbstractQueue:
    """Declare the DLX, the DLQ and its binding, and the jobs queue; return the jobs queue."""
    dlx = await channel.declare_exchange(settings.dead_letter_exchange,
                                         aio_pika.ExchangeType.DIRECT, durable=True)
    dlq = await channel.declare_queue(settings.dead_letter_queue, durable=True,
                                      arguments={"x-queue-type": "quorum"})
    await dlq.bind(dlx, routing_key=settings.jobs_queue)
    return await channel.declare_queue(settings.jobs_queue, durable=True,
                                       arguments=jobs_queue_arguments(settings))


class Published(enum.Enum):
    CONFIRMED = "confirmed"  # the broker routed and confirmed it
    RETURNED = "returned"    # unroutable (the reply queue is gone): basic.return
    GAVE_UP = "gave_up"      # not confirmed before shutdown / the retry budget ran out


class Settle(enum.Enum):
    DONE = "done"
    STALE = "stale"  # the delivery's channel died: the broker already requeued the message
    ALREADY = "already"  # already settled: never twice


class Broker:
    """One robust connection with a consuming channel and a confirming publishing channel."""

    def __init__(self, settings: Settings, metrics: Metrics, name: str = "nllb-worker") -> None:
        self.settings = settings
        self.metrics = metrics
        self.name = name
        self.connection: AbstractRobustConnection | None = None
        self._consume_ch: aio_pika.abc.AbstractRobustChannel | None = None
        self._publish_ch: aio_pika.abc.AbstractRobustChannel | None = None
        self.queue: aio_pika.abc.AbstractRobustQueue | None = None
        self.consumer_tag: str | None = None

    async def connect(self, prefetch: int) -> None:
        url = self.settings.amqp_url.get_secret_value()
        log.info("connecting", url=self.settings.amqp_url_redacted(), prefetch=prefetch)
        self.connection = await aio_pika.connect_robust(
            url, reconnect_interval=self.settings.reconnect_interval_s,
            client_properties={"connection_name": self.name})
        self.connection.reconnect_callbacks.add(self._on_reconnect)
        self.connection.close_callbacks.add(self._on_close)
        self._publish_ch = await self.connection.channel(publisher_confirms=True,
                                                         on_return_raises=True)
        self._consume_ch = await self.connection.channel()
        await self._consume_ch.set_qos(prefetch_count=prefetch)
        self.queue = await declare_topology(self._consume_ch, self.settings)
        log.info("topology declared", jobs_queue=self.settings.jobs_queue,
                 arguments=jobs_queue_arguments(self.settings),
                 dead_letter_queue=self.settings.dead_letter_queue)

    def _on_reconnect(self, *_: Any) -> None:
        self.metrics.reconnects.inc()
        log.warning("reconnected to the broker; consuming resumes")

    def _on_close(self, _conn: Any, exc: BaseException | None = None) -> None:
        if exc is not None and not isinstance(exc, asyncio.CancelledError):
            log.warning("broker connection lost; reconnecting", error=repr(exc))

    async def consume(self, callback: Callable[[AbstractIncomingMessage], Awaitable[None]]) -> None:
        assert self.queue is not None
        self.consumer_tag = await self.queue.consume(callback)
        log.info("consuming", queue=self.settings.jobs_queue, consumer_tag=self.consumer_tag)

    async def cancel(self) -> None:
        """Stop consuming (basic.cancel); messages already delivered stay ours to settle."""
        if self.queue is None or self.consumer_tag is None:
            return
        tag, self.consumer_tag = self.consumer_tag, None
        try:
            await asyncio.wait_for(self.queue.cancel(tag), 10)
        except CONNECTION_ERRORS as e:
            log.warning("consumer cancel failed (connection down: nothing more is delivered)",
                        error=repr(e))

    def connected(self) -> bool:
        c = self.connection
        return bool(c is not None and not c.is_closed and c.connected.is_set()
                    and self._consume_ch is not None and not self._consume_ch.is_closed)

    def consuming(self) -> bool:
        return self.consumer_tag is not None and self.connected()

    async def publish(self, body: bytes, routing_key: str, *, correlation_id: str | None,
                      abort: asyncio.Event | None = None, retry_for_s: float = 3600.0) -> Published:
        """Publish with confirm and mandatory=True. Connection trouble: wait for the robust
        connection and retry (the reply then goes on the new channel), until `abort` is set or
        `retry_for_s` passed."""
        assert self._publish_ch is not None and self.connection is not None
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + retry_for_s
        attempt = 0
        while True:
            attempt += 1
            message = aio_pika.Message(body, content_type="application/json",
                                       correlation_id=correlation_id,
                                       delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            try:
                await self._publish_ch.default_exchange.publish(
                    message, routing_key=routing_key, mandatory=True, timeout=30)
                return Published.CONFIRMED
            except PublishError:
                return Published.RETURNED
            except DeliveryError as e:  # basic.nack from the broker: retry
                err: BaseException = e
            except CONNECTION_ERRORS as e:
                err = e
            self.metrics.publish_retries.inc()
            log.warning("reply publish failed; retrying after reconnection", attempt=attempt,
                        error=repr(err))
            if (abort is not None and abort.is_set()) or loop.time() > give_up_at:
                return Published.GAVE_UP
            waiters = {asyncio.ensure_future(asyncio.sleep(min(0.1 * 2 ** attempt, 2.0)))}
            if abort is not None:
                waiters.add(asyncio.ensure_future(abort.wait()))
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for w in waiters:
                w.cancel()

    async def close(self) -> None:
        if self.connection is not None:
            try:
                await asyncio.wait_for(self.connection.close(), 10)
            except Exception as e:  # noqa: BLE001 - closing on the way out
                log.warning("connection close failed", error=repr(e))


async def settle(message: AbstractIncomingMessage, action: str) -> Settle:
    """Send ack / reject (dead-letter) / nack+requeue for one delivery. Never raises, never twice.

    A delivery from a channel that died cannot be settled: the broker requeued it when the
    channel closed, and a delivery tag from the old channel means nothing on the new one.
    """
    if message.processed:
        return Settle.ALREADY
    try:
        if action == "ack":
            await message.ack()
        elif action == "reject":
            await message.reject(requeue=False)
        elif action == "requeue":
            await message.nack(requeue=True)
        else:
            raise ValueError(f"unknown action {action!r}")
        return Settle.DONE
    except MessageProcessError:
        return Settle.ALREADY
    except CONNECTION_ERRORS:
        return Settle.STALE
