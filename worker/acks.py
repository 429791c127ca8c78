"""Delivery acknowledgements in batches.

The acks asked for while the loop runs one iteration (each after its job's reply was confirmed) leave
together at its end, as one `basic.ack multiple=True` for those reached from the channel's first
unsettled tag through tags asked or settled already, and one plain `basic.ack` for each other. A
multiple ack never covers a delivery that was not asked to be acked.
"""
from __future__ import annotations

import asyncio
import weakref
from collections import deque
from typing import Any, Protocol


class Delivery(Protocol):
    """What acks read of a delivery (worker/amqp.py Delivery): the channel it came on and its tag there."""

    channel: Any
    delivery_tag: int


class _ChannelTags:
    """The settled delivery tags of one channel (tags count up from 1): all up to `settled_upto`,
    and those above it in `above`."""

    def __init__(self) -> None:
        self.settled_upto = 0
        self.above: set[int] = set()

    def settle(self, tag: int) -> None:
        if self.is_settled(tag):
            return
        self.above.add(tag)
        while self.settled_upto + 1 in self.above:
            self.settled_upto += 1
            self.above.discard(self.settled_upto)

    def is_settled(self, tag: int) -> bool:
        return tag <= self.settled_upto or tag in self.above


class Acks:
    """Acks of deliveries, sent together at the end of the loop iteration that asked for them (see
    the module doc); every settled tag is recorded, so that a run is only ever made of tags acked
    in this batch."""

    def __init__(self) -> None:
        self._tags: weakref.WeakKeyDictionary[Any, _ChannelTags] = weakref.WeakKeyDictionary()
        self._pending: dict[Any, dict[int, asyncio.Future[None]]] = {}  # channel -> tag -> its settle's future
        # batches whose frames are made, in the order made: one task writes them, in that order, since a
        # batch's frames count on the batches before it having been written (a full write queue would let
        # a later writer overtake an earlier one)
        self._outbox: deque[tuple[Any, list[tuple[int, bool, list[int]]], dict[int, asyncio.Future[None]]]] = deque()
        self._writer: asyncio.Task[None] | None = None

    def _of(self, channel: Any) -> _ChannelTags:
        tags = self._tags.get(channel)
        if tags is None:
            tags = self._tags[channel] = _ChannelTags()
        return tags

    def settled(self, message: Delivery) -> bool:
        """Acked (or marked settled) here already, or its ack waits in this iteration's batch."""
        tag = message.delivery_tag
        tags = self._tags.get(message.channel)
        return (tags is not None and tags.is_settled(tag)) or tag in self._pending.get(message.channel, ())

    def mark(self, message: Delivery) -> None:
        """Record a delivery settled otherwise (reject, nack)."""
        self._of(message.channel).settle(message.delivery_tag)

    def ack(self, message: Delivery) -> asyncio.Future[None]:
        """Ack the delivery with the batch of this loop iteration; the future raises what the
        channel raised (a closed channel: ChannelInvalidStateError)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.setdefault(message.channel, {})[message.delivery_tag] = done
        return done

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        for channel, done_by_tag in pending.items():
            tags = self._of(channel)
            frames = ack_frames(tags, sorted(done_by_tag))
            for tag in done_by_tag:  # settled from now on: never asked for twice
                tags.settle(tag)
            self._outbox.append((channel, frames, done_by_tag))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        while self._outbox:
            await _send(*self._outbox.popleft())


def ack_frames(tags: _ChannelTags, asked: list[int]) -> list[tuple[int, bool, list[int]]]:
    """The basic.ack frames that ack the delivery tags `asked` (ascending, none settled) of a channel whose
    settled tags are `tags`: (tag, multiple, the tags it acks). One multiple ack for the asked tags reached
    from the first unsettled tag through tags asked or settled already (a multiple ack covers only the
    deliveries not settled yet), when they are two or more; a plain ack for each other tag."""
    n, tag = 0, tags.settled_upto + 1
    while n < len(asked):
        if asked[n] == tag:
            n += 1
        elif not tags.is_settled(tag):
            break
        tag += 1
    if n < 2:
        n = 0
    frames = [(asked[n - 1], True, asked[:n])] if n else []
    return frames + [(tag, False, [tag]) for tag in asked[n:]]


async def _send(channel: Any, frames: list[tuple[int, bool, list[int]]],
                done_by_tag: dict[int, asyncio.Future[None]]) -> None:
    """Write the ack frames; each settle's future resolves once its frame is written, or raises what
    the channel raised."""
    try:
        for tag, multiple, acked in frames:
            await channel.basic_ack(tag, multiple=multiple, wait=False)
            for t in acked:
                _resolve(done_by_tag.pop(t), None)
    except Exception as e:  # noqa: BLE001 - each settle() sees it (a closed channel: stale)
        for done in done_by_tag.values():
            _resolve(done, e)


def _resolve(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)
