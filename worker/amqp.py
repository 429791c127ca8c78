"""RabbitMQ plumbing: robust connection, the topology of PROTOCOL.md, consume, confirmed publish.

The topology and its checks: `worker.topology`.

Three channels: one consumes jobs (QoS = prefetch), one publishes replies in confirm mode with
mandatory=True, so a reply to a queue that is gone comes back as *returned*, not silently lost,
and one consumes control messages.

Jobs are consumed on the aiormq channel under the robust one (`Broker.consume`): a delivery reaches
the worker as a `Delivery`, not as aio-pika's message through a task of aio-pika's of its own, since
at a few thousand jobs a second those cost the event loop a tenth of its time. So the consumer is
made again by the worker on each channel the robust connection reopens, after the broker
cancelled it, and every TOPOLOGY_CHECK_S: each time only once `topology.check_topology` holds (the jobs
queue as declared; what was deleted put back), and while it does not the worker stops consuming and is not
ready. A try that fails on the wire while the connection is up is made again within a few reconnect intervals.

Replies and acks go out in batches, those asked for in one loop iteration together at its end:
replies through `worker.replies.Replies` (`Broker.publish`), acks through `worker.acks.Acks`
(`settle`, which settles one delivery: ack, reject, requeue or republish). Frames are read from the
socket in chunks (`worker.frames`), not one `readexactly` at a time.
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import aio_pika
import aiormq
import structlog
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustConnection
from aio_pika.exceptions import ChannelInvalidStateError, DeliveryError, MessageProcessError, PublishError
from aiormq import spec
from aiormq.abc import DeliveredMessage

from worker.acks import Acks
from worker.frames import use_chunk_frames
from worker.metrics import Metrics
from worker.replies import Replies
from worker.settings import Settings
from worker.topology import (
    TOPOLOGY_CHECK_S,
    WAITING_FOR_MATCH,
    TopologyMismatch,
    check_topology,
    describe_mismatch,
    jobs_queue_arguments,
)

log = structlog.get_logger("worker.amqp")

#: What can go wrong on the wire while the robust connection is (re)connecting.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    ChannelInvalidStateError, aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelClosed, aiormq.exceptions.ConnectionClosed, ConnectionError,
    asyncio.TimeoutError, RuntimeError,
)


#: headers the broker sets on a delivery to count it; a republished copy starts without them
BROKER_COUNTS = frozenset({"x-delivery-count", "x-acquired-count"})


class Published(enum.Enum):
    CONFIRMED = "confirmed"  # the broker routed and confirmed it
    RETURNED = "returned"    # unroutable (the reply queue is gone): basic.return
    REFUSED = "refused"      # nacked for reply_refused_after_s (its queue full, rejecting publishes)
    GAVE_UP = "gave_up"      # not confirmed before shutdown / the retry budget ran out


class Settle(enum.Enum):
    DONE = "done"
    STALE = "stale"  # the delivery's channel died: the broker already requeued the message
    ALREADY = "already"  # already settled: never twice


class Delivery:
    """One delivery of the jobs queue: what the worker reads of it, and the channel to settle it on."""

    __slots__ = ("channel", "delivery_tag", "redelivered", "body", "properties")

    def __init__(self, message: DeliveredMessage) -> None:
        deliver = message.delivery
        assert isinstance(deliver, spec.Basic.Deliver)
        self.channel = message.channel
        self.delivery_tag: int = deliver.delivery_tag
        self.redelivered: bool = deliver.redelivered
        self.body = message.body
        self.properties: spec.Basic.Properties = message.header.properties


class Broker:
    """One robust connection with a consuming channel and a confirming publishing channel."""

    def __init__(self, settings: Settings, metrics: Metrics, name: str = "nllb-worker") -> None:
        self.settings = settings
        self.metrics = metrics
        self.name = name
        self.connection: AbstractRobustConnection | None = None
        self._consume_ch: aio_pika.abc.AbstractRobustChannel | None = None
        self._publish_ch: aio_pika.abc.AbstractRobustChannel | None = None
        self._control_ch: aio_pika.abc.AbstractRobustChannel | None = None
        self.control_queue: aio_pika.abc.AbstractRobustQueue | None = None
        self.consumer_tag: str | None = None
        self._on_delivery: Callable[[Delivery], None] | None = None
        self._on_lost: Callable[[aiormq.abc.AbstractChannel], None] | None = None
        self._consuming: asyncio.Task[None] | None = None  # the consumer made again (reopen, cancel, check)
        self._watching: asyncio.Task[None] | None = None  # the topology checked every TOPOLOGY_CHECK_S
        self.topology_error: str | None = None  # why the topology does not hold now (not consuming meanwhile)
        # the aiormq channel consumed on last: its `consumers` say whether the consumer lives (a broker's
        # basic.cancel or our own drops it there)
        self._consume_underlay: aiormq.abc.AbstractChannel | None = None
        self.acks = Acks()
        self._replies = Replies()
        # reply message ids: unique per process (aiormq matches a returned message to its publish by it)
        self._message_ids = map(f"{uuid.uuid4().hex[:12]}.{{}}".format, itertools.count())

    async def connect(self, prefetch: int) -> None:
        """Connect, open the channels and declare the topology. Whatever fails, the connection
        is closed before this raises, so a caller that retries never holds two. TopologyMismatch
        when the broker's queues were declared with other arguments."""
        await self.close()
        use_chunk_frames()
        url = self.settings.amqp_url.get_secret_value()
        log.info("connecting", url=self.settings.amqp_url_redacted(), prefetch=prefetch)
        try:
            await aio_pika.connect_robust(url, reconnect_interval=self.settings.reconnect_interval_s,
                                          client_properties={"connection_name": self.name},
                                          connection_class=self._held)
            assert self.connection is not None
            self.connection.reconnect_callbacks.add(self._on_reconnect)
            self.connection.close_callbacks.add(self._on_close)
            self._publish_ch = await self.connection.channel(publisher_confirms=True,
                                                             on_return_raises=True)
            self._consume_ch = await self.connection.channel()
            self._consume_ch.reopen_callbacks.add(self._consume_again)
            await self._consume_ch.set_qos(prefetch_count=prefetch)
            # not on the robust consuming channel: it would declare the queues again as it reopens, and a queue
            # declared otherwise meanwhile would then fail every reconnection (check_topology is run instead)
            await check_topology(self.connection, self.settings, None)
            self._control_ch = await self.connection.channel()
            exchange = await self._control_ch.declare_exchange(
                self.settings.control_exchange, aio_pika.ExchangeType.FANOUT, durable=True)
            self.control_queue = await self._control_ch.declare_queue(
                f"{self.settings.control_exchange}.{uuid.uuid4().hex[:16]}", exclusive=True,
                auto_delete=True)
            await self.control_queue.bind(exchange)
        except aiormq.exceptions.ChannelPreconditionFailed as e:
            await self.close()
            raise TopologyMismatch(describe_mismatch(str(e))) from None
        except BaseException:
            await self.close()
            raise
        log.info("topology declared", jobs_queue=self.settings.jobs_queue,
                 arguments=jobs_queue_arguments(self.settings),
                 dead_letter_queue=self.settings.dead_letter_queue)

    def _held(self, *args: Any, **kwargs: Any) -> aio_pika.RobustConnection:
        """connect_robust's connection, held from its making: an attempt cancelled before it connects (a stop, a
        timeout) is closed by `close`, where its reconnection task would otherwise go on trying."""
        self.connection = aio_pika.RobustConnection(*args, **kwargs)
        return self.connection

    def _on_reconnect(self, *_: Any) -> None:
        self.metrics.reconnects.inc()
        log.warning("reconnected to the broker; consuming resumes")

    def _on_close(self, _conn: Any, exc: BaseException | None = None) -> None:
        if exc is not None and not isinstance(exc, asyncio.CancelledError):
            log.warning("broker connection lost; reconnecting", error=repr(exc))

    async def consume(self, on_delivery: Callable[[Delivery], None],
                      on_lost: Callable[[aiormq.abc.AbstractChannel], None]) -> None:
        """Hand each delivery of the jobs queue to `on_delivery`, on the loop; it must return at
        once (aiormq runs it in a task that closing the channel cancels). `on_lost(channel)` when a
        channel that delivered closes: the broker has requeued what it delivered and was not settled."""
        assert self._consume_ch is not None
        self._on_delivery, self._on_lost = on_delivery, on_lost
        self.consumer_tag = f"nllb-{uuid.uuid4().hex}"
        await self._consume_on(await self._consume_ch.get_underlay_channel())
        self._watching = asyncio.ensure_future(self._watch_topology())
        log.info("consuming", queue=self.settings.jobs_queue, consumer_tag=self.consumer_tag)

    async def _consume_on(self, channel: aiormq.abc.AbstractChannel) -> None:
        self._consume_underlay = channel
        if self.consumer_tag is None or self.consumer_tag in channel.consumers:
            return
        channel.on_consumer_cancel_callbacks.add(self._on_consumer_cancel)
        channel.closing.add_done_callback(partial(self._channel_closed, channel))
        await channel.basic_consume(self.settings.jobs_queue, self._deliver, consumer_tag=self.consumer_tag)

    def _channel_closed(self, channel: aiormq.abc.AbstractChannel, _closing: asyncio.Future) -> None:
        assert self._on_lost is not None
        self._on_lost(channel)

    def _deliver(self, message: DeliveredMessage) -> None:
        assert self._on_delivery is not None
        self._on_delivery(Delivery(message))

    def _consume_again(self, *_: Any) -> None:
        """The consumer on the channel now under the robust one. In a task of its own: while the
        robust connection reopens its channels, the channel waits for the connection to be ready."""
        if self.consumer_tag is not None and (self._consuming is None or self._consuming.done()):
            self._consuming = asyncio.ensure_future(self._reconsume())

    async def _reconsume(self) -> None:
        """Consume again where the topology holds; stop consuming where it does not. A try that fails while the
        connection is up is made again, after reconnect_interval_s and then twice as long each time (at most
        TOPOLOGY_CHECK_S), until one succeeds: just after a reconnection the robust connection may still be
        restoring what the broker dropped with the old one (the exclusive control queue the check binds), and a
        process left waiting for the next topology check would consume nothing meanwhile. A try that fails with
        the connection down ends here: the channel's reopen starts this again."""
        assert self._consume_ch is not None
        delay = self.settings.reconnect_interval_s
        while True:
            try:
                holds = await self._topology_holds()
                channel = await self._consume_ch.get_underlay_channel()
                if holds:
                    await self._consume_on(channel)
                elif self.consumer_tag is not None and self.consumer_tag in channel.consumers:
                    await channel.basic_cancel(self.consumer_tag)
                return
            except CONNECTION_ERRORS as e:  # the channel closed, or the check was refused (permissions)
                if not self.connected():
                    log.warning("consuming again failed; tried again when the channel reopens", error=repr(e))
                    return
                log.warning("consuming again failed; trying again", error=repr(e), retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, TOPOLOGY_CHECK_S)

    async def _topology_holds(self) -> bool:
        """check_topology, its verdict logged when it changes."""
        assert self.connection is not None
        control_queue = self.control_queue.name if self.control_queue is not None else None
        try:
            await check_topology(self.connection, self.settings, control_queue)
        except TopologyMismatch as e:
            if self.topology_error != str(e):
                log.error(WAITING_FOR_MATCH, error=str(e))
            self.topology_error = str(e)
            return False
        if self.topology_error is not None:
            log.warning("the broker's queues match this worker's settings again; consuming jobs")
            self.topology_error = None
        return True

    async def _watch_topology(self) -> None:
        while True:
            await asyncio.sleep(TOPOLOGY_CHECK_S)
            if self.connected():
                self._consume_again()

    def _on_consumer_cancel(self, frame: spec.Basic.Cancel) -> None:
        """The broker cancelled the consumer (its queue was deleted, say): consume again. A queue
        that is gone closes the channel, and the robust channel declares the queue anew."""
        if frame.consumer_tag == self.consumer_tag:
            log.warning("the broker cancelled the jobs consumer; consuming again")
            self._consume_again()

    async def consume_control(self, on_body: Callable[[bytes], None]) -> None:
        """Hand each control message's body to `on_body` (on the loop), then ack it: a control
        message is never redelivered, whatever it holds."""
        assert self.control_queue is not None

        async def on_message(message: AbstractIncomingMessage) -> None:
            try:
                on_body(message.body)
            except Exception:  # noqa: BLE001 - a control message never stops the consumer
                log.exception("control message failed")
            with contextlib.suppress(*CONNECTION_ERRORS, MessageProcessError):
                await message.ack()
        await self.control_queue.consume(on_message)
        log.info("consuming control messages", exchange=self.settings.control_exchange,
                 queue=self.control_queue.name)

    async def cancel(self) -> None:
        """Stop consuming (basic.cancel); messages already delivered stay ours to settle."""
        self._stop_watching()
        if self._consume_ch is None or self.consumer_tag is None:
            return
        tag, self.consumer_tag = self.consumer_tag, None
        try:
            channel = await asyncio.wait_for(self._consume_ch.get_underlay_channel(), 10)
            await asyncio.wait_for(channel.basic_cancel(tag), 10)
        except CONNECTION_ERRORS as e:
            log.warning("consumer cancel failed (connection down: nothing more is delivered)",
                        error=repr(e))

    def connected(self) -> bool:
        c = self.connection
        return bool(c is not None and not c.is_closed and c.connected.is_set()
                    and self._consume_ch is not None and not self._consume_ch.is_closed)

    def consuming(self) -> bool:
        channel = self._consume_underlay
        return (self.consumer_tag is not None and channel is not None and not channel.is_closed
                and self.consumer_tag in channel.consumers and self.topology_error is None and self.connected())

    async def publish(self, body: bytes, routing_key: str, *, correlation_id: str | None,
                      abort: asyncio.Event | None = None, retry_for_s: float = 3600.0) -> Published:
        """Publish with confirm and mandatory=True. Connection trouble: wait for the robust
        connection and retry (the reply then goes on the new channel), until `abort` is set or
        `retry_for_s` passed. Nacks are retried for settings.reply_refused_after_s from the first: a
        broker's passing trouble clears within it, a reply queue that stays full (a client that stopped
        consuming, x-overflow reject-publish) does not, and its job must not be held unacked meanwhile."""
        assert self._publish_ch is not None and self.connection is not None
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + retry_for_s
        refused_at: float | None = None  # give up on nacks from then
        attempt = 0
        while True:
            attempt += 1
            try:
                channel = await self._publish_ch.get_underlay_channel()
                await self._replies.publish(channel, body, routing_key, correlation_id, next(self._message_ids))
                return Published.CONFIRMED
            except PublishError:
                return Published.RETURNED
            except DeliveryError as e:  # basic.nack from the broker: retry for a while
                if refused_at is None:
                    refused_at = loop.time() + self.settings.reply_refused_after_s
                elif loop.time() >= refused_at:
                    return Published.REFUSED
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

    async def publish_interim(self, body: bytes, routing_key: str, *, correlation_id: str | None) -> None:
        """An interim message (a job's `partial`) on the replies' channel, so that it stays ahead of
        the job's final reply: once, transient, not mandatory (a reply queue that is gone drops
        it). Raises what the publish raised; nothing waits for it but its own task."""
        assert self._publish_ch is not None
        message = aio_pika.Message(body, content_type="application/json", correlation_id=correlation_id,
                                   delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT)
        await self._publish_ch.default_exchange.publish(message, routing_key=routing_key, mandatory=False,
                                                        timeout=10)

    async def republish(self, message: Delivery) -> bool:
        """Put a copy of a delivery at the back of the jobs queue (confirmed): the same body and
        properties, less the broker's delivery counts (and user_id, which the broker checks
        against this connection's user). False when the broker did not confirm it."""
        assert self._publish_ch is not None
        p = message.properties
        headers = {k: v for k, v in (p.headers or {}).items() if k not in BROKER_COUNTS}
        copy = spec.Basic.Properties(
            content_type=p.content_type, content_encoding=p.content_encoding, headers=headers,
            delivery_mode=p.delivery_mode, priority=p.priority, correlation_id=p.correlation_id,
            reply_to=p.reply_to, expiration=p.expiration, message_id=p.message_id, timestamp=p.timestamp,
            message_type=p.message_type, app_id=p.app_id)
        try:
            channel = await self._publish_ch.get_underlay_channel()
            await channel.basic_publish(message.body, routing_key=self.settings.jobs_queue, properties=copy,
                                        mandatory=True, timeout=10)
            return True
        except (PublishError, DeliveryError, *CONNECTION_ERRORS) as e:
            log.warning("republishing the job failed; the broker requeues it instead",
                        error=repr(e))
            return False

    def _stop_watching(self) -> None:
        """The topology watch and a consumer being made again, stopped (the connection is closing)."""
        for task in (self._watching, self._consuming):
            if task is not None:
                task.cancel()
        self._watching = self._consuming = None

    async def close(self) -> None:
        self._stop_watching()
        connection, self.connection = self.connection, None
        if connection is not None:
            try:
                await asyncio.wait_for(connection.close(), 10)
            except Exception as e:  # noqa: BLE001 - closing on the way out
                log.warning("connection close failed", error=repr(e))


async def settle(message: Delivery, action: str, broker: Broker) -> Settle:
    """Settle one delivery; never raises, never twice. The actions:

    - "ack": done with it.
    - "reject": basic.reject without requeue: to the dead letters.
    - "retry": basic.reject with requeue: a failed attempt, which every RabbitMQ counts toward the
      delivery limit, so that a job failing on every delivery ends as a dead letter.
    - "release": basic.nack with requeue: given back through no fault of its own; RabbitMQ 4.3 and later
      do not count a nack toward the limit (3.x and 4.0-4.2 count every return).
    - "republish": a copy at the back of the queue, confirmed, then the original acked, so that no
      broker counts a delivery; "release" when the copy is not confirmed.

    A delivery from a channel that died cannot be settled: the broker requeued it when the
    channel closed, and a delivery tag from the old channel means nothing on the new one.
    """
    if broker.acks.settled(message):
        return Settle.ALREADY
    if message.channel.is_closed:  # before a republish too: the copy would be a second job beside the original
        return Settle.STALE
    try:
        if action == "republish":
            action = "ack" if await broker.republish(message) else "release"
        if action == "ack":
            await broker.acks.ack(message)
        elif action == "reject":
            await message.channel.basic_reject(message.delivery_tag, requeue=False)
        elif action == "retry":
            await message.channel.basic_reject(message.delivery_tag, requeue=True)
        elif action == "release":
            await message.channel.basic_nack(message.delivery_tag, requeue=True)
        else:
            raise ValueError(f"unknown action {action!r}")
        broker.acks.mark(message)
        return Settle.DONE
    except CONNECTION_ERRORS:
        return Settle.STALE
