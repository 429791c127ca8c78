"""Reply publishing in batches: confirmed, mandatory publishes to the default exchange.

Mandatory, so that a reply to a queue that is gone comes back (basic.return) and its job is dead-lettered; a reply
to a direct reply-to name (`amq.rabbitmq.reply-to.*`) is not mandatory: RabbitMQ returns a mandatory publish to one
even as it delivers it, and has no queue whose absence a return could report.

The replies asked for in one loop iteration (`Replies.publish`) are written as one buffer of frames
under one hold of the channel's lock, each registered for its confirm (and for a `basic.return`, by
message id) in aiormq's channel exactly as its `basic_publish` registers one. One `basic_publish` a
reply cost the loop a timeout, two async context managers, a write-queue put and a socket write each.
This uses aiormq's channel attributes (`lock`, `delivery_tag`, `confirmations`,
`message_id_delivery_tag`, `write_queue`, those of aiormq 7.2), so an aiormq upgrade is checked
against it: tests/worker publishes every reply through it, returned and confirmed ones too.

The frames are encoded here (`publish_frames`), not by pamqp: its general encoder, which looks up every
property's type by name, took ~34 us a reply on the 2-core machine, a tenth of the loop's time a job;
these few struct packs take ~3. tests/worker/test_reply_frames.py holds them to pamqp's bytes.
"""
from __future__ import annotations

import asyncio
import struct
from collections import deque
from typing import Any

import aiormq
from aiormq.abc import ChannelFrame

from worker.frames import BASIC, BODY, CONTENT_HEAD, FRAME_END, FRAME_HEAD, HEADER, METHOD

CONFIRM_TIMEOUT_S = 30.0  # a reply the broker has not confirmed by then is published again
EXPIRY_CHECK_S = 1.0  # how often the unconfirmed replies are checked against their deadline

#: a reply waiting for its batch: its body, routing key (the producer's reply_to), correlation id, message id
#: and the future of its confirmation
Pending = tuple[bytes, str, "str | None", str, "asyncio.Future[Any]"]


class Replies:
    """Confirmed, mandatory publishes to the default exchange, written in batches (see the module doc)."""

    def __init__(self) -> None:
        self._pending: dict[aiormq.abc.AbstractChannel, list[Pending]] = {}
        self._writing: set[asyncio.Task[None]] = set()  # held until done: the loop keeps only weak references
        # (deadline on the loop's clock, confirmation) of each publish, in publish order: one timer a second fails
        # those the broker has not confirmed by their deadline, where a timeout each cost the loop ~5 us a reply
        self._unconfirmed: deque[tuple[float, asyncio.Future[Any]]] = deque()
        self._expiry: asyncio.TimerHandle | None = None

    def publish(self, channel: aiormq.abc.AbstractChannel, body: bytes, routing_key: str,
                correlation_id: str | None, message_id: str) -> asyncio.Future[Any]:
        """The publish's confirmation: resolves at the broker's basic.ack, raises PublishError at its
        basic.return, DeliveryError at its basic.nack, the channel's error when it closes first, and
        TimeoutError when no answer came in CONFIRM_TIMEOUT_S. `message_id` must be the publish's own; the
        message carries REPLY_PROPERTIES' content type and delivery mode besides the two ids."""
        loop = asyncio.get_running_loop()
        confirmation = channel.create_future()  # rejected by the channel when it closes
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.setdefault(channel, []).append((body, routing_key, correlation_id, message_id, confirmation))
        self._unconfirmed.append((loop.time() + CONFIRM_TIMEOUT_S, confirmation))
        if self._expiry is None:
            self._expiry = loop.call_later(EXPIRY_CHECK_S, self._expire)
        return confirmation

    def _expire(self) -> None:
        """Fail the confirmations past their deadline; forget the answered ones ahead of the first still waiting."""
        loop = asyncio.get_running_loop()
        now, unconfirmed = loop.time(), self._unconfirmed
        while unconfirmed and (unconfirmed[0][1].done() or unconfirmed[0][0] <= now):
            confirmation = unconfirmed.popleft()[1]
            if not confirmation.done():
                confirmation.set_exception(TimeoutError(f"the broker did not confirm a reply in "
                                                        f"{CONFIRM_TIMEOUT_S:.0f} s"))
        self._expiry = loop.call_later(EXPIRY_CHECK_S, self._expire) if unconfirmed else None

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        for channel, batch in pending.items():
            task = asyncio.ensure_future(_write_replies(channel, batch))
            self._writing.add(task)
            task.add_done_callback(self._writing.discard)


async def _write_replies(channel: Any, batch: list[Pending]) -> None:
    """Under the channel's lock, as its basic_publish does, so that the frames reach the broker in the
    order of their delivery tags."""
    try:
        async with channel.lock:
            frames: list[bytes] = []
            for body, routing_key, correlation_id, message_id, confirmation in batch:
                if confirmation.done():  # the channel closed, or the caller gave up
                    continue
                channel.delivery_tag += 1
                tag = channel.delivery_tag
                channel.confirmations[tag] = confirmation
                channel.message_id_delivery_tag[message_id] = tag
                confirmation.add_done_callback(
                    lambda _, mid=message_id: channel.message_id_delivery_tag.pop(mid, None))
                frames.append(publish_frames(channel.number, routing_key, body, correlation_id, message_id,
                                             channel.max_content_size))
            if frames:
                await channel.write_queue.put(ChannelFrame(payload=b"".join(frames), should_close=False))
    except Exception as e:  # noqa: BLE001 - each publisher sees it (a closed channel: it retries)
        for *_, confirmation in batch:
            if not confirmation.done():
                confirmation.set_exception(e)


#: what every reply carries besides its ids: JSON, persistent (delivery mode 2)
REPLY_PROPERTIES = {"content_type": "application/json", "delivery_mode": 2}

_FRAME_END = bytes((FRAME_END,))
# Basic.Publish (method 40), ticket 0, exchange "" (the default); then the routing key, then the flags
_PUBLISH = struct.pack(">HHHB", BASIC, 40, 0, 0)
_MANDATORY, _NOT_MANDATORY = b"\x01", b"\x00"
DIRECT_REPLY_TO = "amq.rabbitmq.reply-to"
# Basic.Properties' flags of content_type, delivery_mode, correlation_id, message_id, in the order of their values
_CONTENT_TYPE, _DELIVERY_MODE, _CORRELATION_ID, _MESSAGE_ID = 0x8000, 0x1000, 0x0400, 0x0080


def publish_frames(channel_number: int, routing_key: str, body: bytes, correlation_id: str | None,
                   message_id: str, max_content: int) -> bytes:
    """The frames of a Basic.Publish of a reply to the default exchange, as pamqp marshals them (mandatory unless
    `routing_key` is a direct reply-to name, see the module doc): the
    method, the content header with REPLY_PROPERTIES and the two ids (an empty or None id is left out, as pamqp
    leaves it), and as many body frames of at most `max_content` bytes as the body takes. ValueError for a
    short string (routing key, ids) over 255 bytes."""
    flags = _CONTENT_TYPE | _DELIVERY_MODE
    values = [_REPLY_CONTENT_TYPE, _REPLY_DELIVERY_MODE]
    if correlation_id:
        flags |= _CORRELATION_ID
        values.append(_short_string(correlation_id))
    if message_id:
        flags |= _MESSAGE_ID
        values.append(_short_string(message_id))
    mandatory = _NOT_MANDATORY if routing_key.startswith(DIRECT_REPLY_TO) else _MANDATORY
    frames = [_frame(METHOD, channel_number, b"".join((_PUBLISH, _short_string(routing_key), mandatory))),
              _frame(HEADER, channel_number, CONTENT_HEAD.pack(BASIC, 0, len(body), flags) + b"".join(values))]
    frames += [_frame(BODY, channel_number, body[i:i + max_content]) for i in range(0, len(body), max_content)]
    return b"".join(frames)


def _frame(kind: int, channel_number: int, payload: bytes) -> bytes:
    return b"".join((FRAME_HEAD.pack(kind, channel_number, len(payload)), payload, _FRAME_END))


def _short_string(value: str) -> bytes:
    encoded = value.encode()
    if len(encoded) > 255:
        raise ValueError(f"a short string is at most 255 bytes; this one is {len(encoded)}")
    return bytes((len(encoded),)) + encoded


_REPLY_CONTENT_TYPE = _short_string(str(REPLY_PROPERTIES["content_type"]))
_REPLY_DELIVERY_MODE = bytes((int(REPLY_PROPERTIES["delivery_mode"]),))
