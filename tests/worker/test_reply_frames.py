"""The reply's frames, encoded by worker.replies, against pamqp's own marshalling (the oracle), and the deadline
that fails a reply the broker never confirms. No broker: every reply of the other worker tests goes through a
real one."""
from __future__ import annotations

import asyncio
import itertools

import pytest
from aiormq.abc import ChannelFrame
from pamqp import commands as spec
from pamqp import frame as pamqp_frame
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from worker import replies
from worker.replies import REPLY_PROPERTIES, Replies, publish_frames

pytestmark = pytest.mark.timeout(30)


def pamqp_publish(channel_number: int, routing_key: str, body: bytes, correlation_id: str | None,
                  message_id: str, max_content: int) -> bytes:
    """What aiormq's basic_publish writes for the same reply."""
    properties = spec.Basic.Properties(correlation_id=correlation_id, message_id=message_id, **REPLY_PROPERTIES)
    mandatory = not routing_key.startswith("amq.rabbitmq.reply-to")  # RabbitMQ returns those even when it delivers
    frames = [spec.Basic.Publish(routing_key=routing_key, mandatory=mandatory),
              ContentHeader(properties=properties, body_size=len(body))]
    frames += [ContentBody(body[i:i + max_content]) for i in range(0, len(body), max_content)]
    return ChannelFrame.marshall(channel_number=channel_number, frames=frames).payload


@pytest.mark.parametrize("channel_number", [1, 7, 65535])
def test_reply_frames_are_the_bytes_pamqp_marshals(channel_number):
    routing_keys = ["", "amq.gen-JzTY20BRgKO-HjmUJj0wLg", "réponses.été", "r" * 255,
                    "amq.rabbitmq.reply-to.g1h2AA5yZXBseUAxMDM4NDY4MjIAAAQ4AAAAAGZk"]
    correlation_ids = [None, "", "0", "job-42 ✓", "c" * 255]
    message_ids = ["", "0123456789ab.0", "0123456789ab.123456789"]
    sizes = [(0, 16), (1, 16), (15, 16), (16, 16), (17, 16), (53, 16), (300, 131064)]
    for key, cid, mid, (n, step) in itertools.product(routing_keys, correlation_ids, message_ids, sizes):
        body = bytes(i % 251 for i in range(n))
        ours = publish_frames(channel_number, key, body, cid, mid, step)
        assert ours == pamqp_publish(channel_number, key, body, cid, mid, step), (key, cid, mid, n, step)


def test_reply_frames_decode_to_the_publish_they_encode():
    body = b'{"v": 1, "status": "ok"}' * 3
    data = publish_frames(3, "replies.a", body, "corr-1", "m.1", 32)
    decoded = []
    while data:
        used, channel_number, frame = pamqp_frame.unmarshal(data)
        decoded.append((channel_number, frame))
        data = data[used:]
    (c0, method), (c1, header), *bodies = decoded
    assert {c0, c1, *(c for c, _ in bodies)} == {3}
    assert (method.exchange, method.routing_key, method.mandatory, method.immediate) == ("", "replies.a", True, False)
    p = header.properties
    assert (header.body_size, p.content_type, p.delivery_mode, p.correlation_id, p.message_id) == (
        len(body), "application/json", 2, "corr-1", "m.1")
    assert b"".join(f.value for _, f in bodies) == body and [len(f.value) for _, f in bodies] == [32, 32, 8]


def test_a_short_string_over_255_bytes_is_refused():
    with pytest.raises(ValueError, match="255"):
        publish_frames(1, "é" * 128, b"{}", None, "m", 16)
    with pytest.raises(ValueError, match="255"):
        publish_frames(1, "q", b"{}", "c" * 256, "m", 16)


class FakeChannel:
    """The attributes of an aiormq channel that Replies uses; nothing ever confirms."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.delivery_tag = 0
        self.confirmations: dict[int, asyncio.Future[object]] = {}
        self.message_id_delivery_tag: dict[str, int] = {}
        self.number, self.max_content_size = 1, 131064
        self.write_queue: asyncio.Queue[ChannelFrame] = asyncio.Queue()

    def create_future(self) -> asyncio.Future[object]:
        return asyncio.get_running_loop().create_future()


def test_a_reply_the_broker_never_confirms_fails_with_a_timeout_and_a_confirmed_one_does_not(monkeypatch):
    monkeypatch.setattr(replies, "CONFIRM_TIMEOUT_S", 0.1)
    monkeypatch.setattr(replies, "EXPIRY_CHECK_S", 0.02)

    async def main() -> None:
        channel, out = FakeChannel(), Replies()
        confirmed = out.publish(channel, b"{}", "q", "c1", "m1")
        unanswered = out.publish(channel, b"{}", "q", "c2", "m2")
        frame = await asyncio.wait_for(channel.write_queue.get(), 1)
        assert frame.payload == publish_frames(1, "q", b"{}", "c1", "m1", 131064) + \
            publish_frames(1, "q", b"{}", "c2", "m2", 131064)  # one batch, in publish order
        assert channel.confirmations == {1: confirmed, 2: unanswered}
        channel.confirmations.pop(1).set_result(None)  # the broker's basic.ack of the first
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(unanswered, 1)
        assert confirmed.result() is None and channel.message_id_delivery_tag == {}
        await asyncio.sleep(0.05)
        assert out._expiry is None  # nothing left to watch: the timer stops

    asyncio.run(main())
