"""Reply publishing in batches: confirmed, mandatory publishes to the default exchange.

The replies asked for in one loop iteration (`Replies.publish`) are written as one buffer of frames
under one hold of the channel's lock, each registered for its confirm (and for a `basic.return`, by
message id) in aiormq's channel exactly as its `basic_publish` registers one. One `basic_publish` a
reply cost the loop a timeout, two async context managers, a write-queue put and a socket write each.
This uses aiormq's channel attributes (`lock`, `delivery_tag`, `confirmations`,
`message_id_delivery_tag`, `write_queue`, those of aiormq 7.2), so an aiormq upgrade is checked
against it: tests/worker publishes every reply through it, returned and confirmed ones too.
"""
from __future__ import annotations

import asyncio
from typing import Any

import aiormq
from aiormq import spec
from aiormq.abc import ChannelFrame
from pamqp.body import ContentBody
from pamqp.header import ContentHeader


class Replies:
    """Confirmed, mandatory publishes to the default exchange, written in batches (see the module doc)."""

    def __init__(self) -> None:
        self._pending: dict[aiormq.abc.AbstractChannel, list[tuple[bytes, str, spec.Basic.Properties,
                                                                   asyncio.Future[Any]]]] = {}
        self._writing: set[asyncio.Task[None]] = set()  # held until done: the loop keeps only weak references

    def publish(self, channel: aiormq.abc.AbstractChannel, body: bytes, routing_key: str,
                properties: spec.Basic.Properties) -> asyncio.Future[Any]:
        """The publish's confirmation: resolves at the broker's basic.ack, raises PublishError at its
        basic.return, DeliveryError at its basic.nack, and the channel's error when it closes first.
        `properties` must carry a message id of its own."""
        confirmation = channel.create_future()  # rejected by the channel when it closes
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.setdefault(channel, []).append((body, routing_key, properties, confirmation))
        return confirmation

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        for channel, batch in pending.items():
            task = asyncio.ensure_future(_write_replies(channel, batch))
            self._writing.add(task)
            task.add_done_callback(self._writing.discard)


async def _write_replies(channel: Any, batch: list[tuple[bytes, str, spec.Basic.Properties, asyncio.Future[Any]]]
                         ) -> None:
    """Under the channel's lock, as its basic_publish does, so that the frames reach the broker in the
    order of their delivery tags."""
    try:
        async with channel.lock:
            frames: list[Any] = []
            for body, routing_key, properties, confirmation in batch:
                if confirmation.done():  # the channel closed, or the caller gave up
                    continue
                channel.delivery_tag += 1
                tag = channel.delivery_tag
                channel.confirmations[tag] = confirmation
                channel.message_id_delivery_tag[properties.message_id] = tag
                confirmation.add_done_callback(
                    lambda _, mid=properties.message_id: channel.message_id_delivery_tag.pop(mid, None))
                frames += [spec.Basic.Publish(routing_key=routing_key, mandatory=True),
                           ContentHeader(properties=properties, body_size=len(body))]
                step = channel.max_content_size
                frames += [ContentBody(body[i:i + step]) for i in range(0, len(body), step)]
            if frames:
                await channel.write_queue.put(ChannelFrame.marshall(frames=frames, channel_number=channel.number))
    except Exception as e:  # noqa: BLE001 - each publisher sees it (a closed channel: it retries)
        for *_, confirmation in batch:
            if not confirmation.done():
                confirmation.set_exception(e)
