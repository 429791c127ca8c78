"""worker.frames' ChunkFrameReceiver against aiormq's own FrameReceiver (the oracle, pamqp's decoding) on the same
bytes, however the socket's reads cut them; its errors at a connection's end and on frames that are not ones; and
property strings that are not UTF-8, which pamqp refuses, read with U+FFFD."""
from __future__ import annotations

import asyncio
import datetime
import random
import struct

import pytest
from aiormq.connection import FrameReceiver
from aiormq.exceptions import AMQPConnectionError, InvalidFrameError, ProtocolSyntaxError
from pamqp import commands as spec
from pamqp import frame as pamqp_frame
from pamqp.body import ContentBody
from pamqp.exceptions import PAMQPException
from pamqp.header import ContentHeader
from pamqp.heartbeat import Heartbeat

from worker.frames import MAX_NESTING, ChunkFrameReceiver

pytestmark = pytest.mark.timeout(30)


def stream() -> bytes:
    """Deliveries with every kind of property, bodies over several frames, confirms and a heartbeat."""
    stamp = datetime.datetime(2026, 12, 3, 9, 30, tzinfo=datetime.timezone.utc)
    frames = [(0, spec.Connection.Start(server_properties={"product": "RabbitMQ"}))]
    for i in range(12):
        body = f'{{"v": 1, "text": "sentence {i} ✓"}}'.encode() * (1 + 40 * (i % 3))
        headers = {"x-delivery-count": i, "trace": "é", "nested": {"list": [1, "b", {"deep": True}], "f": 0.5},
                   "when": stamp, "none": None} if i % 3 else None
        props = spec.Basic.Properties(content_type="application/json", correlation_id=str(i), reply_to="amq.gen-x",
                                      message_id=f"m{i}", delivery_mode=2, timestamp=stamp if i % 2 else None,
                                      headers=headers, priority=i % 10, expiration="60000" if i == 5 else None,
                                      content_encoding="utf-8" if i == 4 else None,
                                      message_type="job" if i == 7 else None, user_id="guest" if i == 8 else None,
                                      app_id="producer ✓" if i == 9 else None)
        frames += [(1, spec.Basic.Deliver(consumer_tag="nllb-1", delivery_tag=i + 1 + (2**40 if i == 3 else 0),
                                          redelivered=bool(i % 2), exchange="jobs.x" if i == 2 else "",
                                          routing_key="nllb.jobs")),
                   (1, ContentHeader(properties=props, body_size=len(body)))]
        frames += [(1, ContentBody(body[j:j + 512])) for j in range(0, len(body), 512)]
        frames.append((2, spec.Basic.Ack(delivery_tag=i + 1, multiple=i % 4 == 0)))
        frames.append((2, spec.Basic.Nack(delivery_tag=i + 1, multiple=False, requeue=True)))
        if i == 6:
            frames.append((0, Heartbeat()))
    return b"".join(pamqp_frame.marshal(frame, channel) for channel, frame in frames)


async def received(chunks: list[bytes]) -> list[tuple[int, int, bytes]]:
    """Each frame as (bytes, channel, the frame marshalled again), from a socket whose reads return `chunks`."""
    reader = asyncio.StreamReader()
    receiver = ChunkFrameReceiver(reader)

    async def feed() -> None:
        for chunk in chunks:
            reader.feed_data(chunk)
            await asyncio.sleep(0)
        reader.feed_eof()

    feeding = asyncio.ensure_future(feed())
    out = []
    async for weight, channel, frame in receiver:
        out.append((weight, channel, pamqp_frame.marshal(frame, channel)))
    await feeding
    return out


async def aiormq_frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """aiormq's receiver over the whole stream, its end already known (it sees the end only between frames)."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return [(weight, channel, pamqp_frame.marshal(frame, channel))
            async for weight, channel, frame in FrameReceiver(reader)]


def cut(data: bytes, sizes: list[int]) -> list[bytes]:
    chunks, at, k = [], 0, 0
    while at < len(data):
        chunks.append(data[at:at + sizes[k % len(sizes)]])
        at += sizes[k % len(sizes)]
        k += 1
    return chunks


@pytest.mark.parametrize("sizes", [[1], [7], [8], [3, 500, 1], [65536], "random"])
def test_chunked_reads_give_the_frames_aiormq_reads(sizes):
    data = stream()
    if sizes == "random":
        rng = random.Random(7)
        sizes = [rng.randint(1, 3000) for _ in range(200)]
    expected = asyncio.run(aiormq_frames(data))
    assert len(expected) > 40
    assert asyncio.run(received(cut(data, sizes))) == expected


def test_a_connection_that_ends_inside_a_frame_is_a_connection_error_and_between_frames_the_end():
    data = stream()
    with pytest.raises(AMQPConnectionError, match="inside a frame"):
        asyncio.run(received([data[:-3]]))
    assert asyncio.run(received([])) == []


def test_bytes_that_are_no_frame_and_another_protocol_header_are_refused():
    good = pamqp_frame.marshal(spec.Basic.Ack(delivery_tag=1), 1)
    with pytest.raises(InvalidFrameError, match="frame end"):
        asyncio.run(received([good[:-1] + b"\x00"]))
    with pytest.raises(InvalidFrameError):  # a method pamqp does not know
        asyncio.run(received([b"\x01\x00\x01\x00\x00\x00\x04\x03\xe7\x00\x01\xce"]))
    with pytest.raises(ProtocolSyntaxError):
        asyncio.run(received([b"AMQP\x00\x00\x09\x01"]))


def test_strings_that_are_not_utf8_read_as_replacement_characters_and_the_rest_as_sent():
    def short(raw: bytes) -> bytes:
        return bytes((len(raw),)) + raw

    entry = short(b"k-\xed\xa0\x80") + b"F" + struct.pack(">I", 6) + short(b"\xff") + b"I" + struct.pack(">i", 7)
    header = (struct.pack(">HHQH", 60, 0, 5, 0x8000 | 0x2000 | 0x0400 | 0x0200 | 0x0080) + short(b"application/json")
              + struct.pack(">I", len(entry)) + entry + short(b"c-\xff\xfe") + short(b"r-\xc0\xaf") + short(b"m"))
    deliver = (struct.pack(">HH", 60, 60) + short(b"nllb-1") + struct.pack(">Q", 9) + b"\x01" + short(b"x-\xff")
               + short(b"q"))
    frames = [struct.pack(">BHI", kind, 1, len(payload)) + payload + b"\xce"
              for kind, payload in ((1, deliver), (2, header), (3, b"hello"))]
    async def read_all() -> list:
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(frames))
        reader.feed_eof()
        return [item async for item in ChunkFrameReceiver(reader)]

    got = asyncio.run(read_all())
    assert [(weight, channel) for weight, channel, _ in got] == [(len(f), 1) for f in frames]
    deliver_frame, header_frame, body_frame = (frame for _, _, frame in got)
    assert (deliver_frame.consumer_tag, deliver_frame.delivery_tag, deliver_frame.redelivered, deliver_frame.exchange,
            deliver_frame.routing_key) == ("nllb-1", 9, True, "x-\ufffd", "q")
    p = header_frame.properties
    assert (header_frame.body_size, p.content_type, p.correlation_id, p.reply_to, p.message_id) == (
        5, "application/json", "c-\ufffd\ufffd", "r-\ufffd\ufffd", "m")
    assert p.headers == {"k-\ufffd\ufffd\ufffd": {"\ufffd": 7}} and body_frame.value == b"hello"


def test_values_python_cannot_hold_read_as_none_and_the_properties_after_them_as_sent():
    """A timestamp past year 9999 (microseconds sent for seconds) and headers nested past MAX_NESTING, which pamqp
    refuses (ValueError, RecursionError) with the connection, read as None; everything around them as sent."""
    def short(raw: bytes) -> bytes:
        return bytes((len(raw),)) + raw

    def nested(depth: int) -> bytes:  # {"a": {"a": ... {} ...}}, `depth` tables below this one
        inner = b""
        for _ in range(depth):
            inner = short(b"a") + b"F" + struct.pack(">I", len(inner)) + inner
        return inner

    micros = int(datetime.datetime(2026, 12, 3, tzinfo=datetime.timezone.utc).timestamp() * 1e6)
    entries = (short(b"x-delivery-count") + b"l" + struct.pack(">q", 2) + short(b"when") + b"T"
               + struct.pack(">Q", micros) + short(b"deep") + b"F" + struct.pack(">I", len(nested(1000)))
               + nested(1000) + short(b"list") + b"A" + struct.pack(">I", 14) + b"T" + struct.pack(">Q", 2**63)
               + b"I" + struct.pack(">i", 5))
    flags = 0x8000 | 0x2000 | 0x0400 | 0x0200 | 0x0080 | 0x0040
    header = (struct.pack(">HHQH", 60, 0, 5, flags) + short(b"application/json") + struct.pack(">I", len(entries))
              + entries + short(b"c-1") + short(b"r-1") + short(b"m-1") + struct.pack(">Q", micros))
    data = struct.pack(">BHI", 2, 1, len(header)) + header + b"\xce"
    with pytest.raises(PAMQPException):  # the oracle refuses it
        pamqp_frame.unmarshal(data)

    async def first():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await ChunkFrameReceiver(reader).get_frame()

    _, _, frame = asyncio.run(first())
    p = frame.properties
    assert (p.content_type, p.correlation_id, p.reply_to, p.message_id, p.timestamp) == (
        "application/json", "c-1", "r-1", "m-1", None)
    deep, level = p.headers["deep"], 1
    while deep is not None:
        deep, level = deep["a"], level + 1
    assert level == MAX_NESTING + 1
    assert {k: v for k, v in p.headers.items() if k != "deep"} == {"x-delivery-count": 2, "when": None,
                                                                     "list": [None, 5]}
