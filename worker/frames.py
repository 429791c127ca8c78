"""AMQP frames read from the socket in chunks and decoded with tolerance: the worker's connections read with
`ChunkFrameReceiver`.

aiormq's `FrameReceiver` reads every frame with three awaited `readexactly` calls (type, header, payload) under
a lock, into a `BytesIO` of its own: a delivery is three frames and a confirm one more, so ~13 awaits and their
objects a job, which took the event loop ~7% of its time a job on the 2-core machine. `ChunkFrameReceiver`
reads whatever the socket holds (one await), cuts every whole frame out of it and hands them out one by one.

The frames a job brings are decoded here (`decode_frame`): a delivery's Basic.Deliver, content header and
body, and the confirms' Basic.Ack; pamqp decodes every other frame. pamqp's general decoder took ~30 us a job
on the 2-core machine, and it refuses a short string that is not UTF-8 with an error that ends the
connection: a producer writing any bytes into a message id, a correlation id, a reply_to or a header's name
(clients of other languages can; the broker passes them on) made every worker that took the message drop
its connection, and all it held, until the broker dead-lettered it. Here such bytes become U+FFFD, as
`bytes.decode(errors="replace")` makes them, and the job is answered like any other (a reply_to so decoded
names no queue: its reply comes back unroutable). Values Python cannot hold are read as None in the same way,
where pamqp raises and ends the connection: a timestamp past year 9999 (one in microseconds, say), and a table
or array nested more than MAX_NESTING deep (pamqp recurses until Python's stack runs out); the frame's sizes
say where each ends, so what follows reads as sent. Everything else is pamqp's own result, which
tests/worker/test_frames.py holds it to.

Errors are aiormq's: `AMQPConnectionError` when the connection ends inside a frame or fails,
`InvalidFrameError` for a frame that is not one, `ProtocolSyntaxError` when the server answers the protocol
header with its own.

`use_chunk_frames()` makes aiormq's connections made afterwards in this process read this way (aiormq makes
its receiver by the module-level name `aiormq.connection.FrameReceiver`, aiormq 7.2); tests/worker runs every
frame the worker reads through it.
"""
from __future__ import annotations

import asyncio
import struct
from collections import deque
from typing import Any

import aiormq.connection
import pamqp.decode
import pamqp.frame
from aiormq.exceptions import AMQPConnectionError, InvalidFrameError, ProtocolSyntaxError
from pamqp import commands as spec
from pamqp.body import ContentBody
from pamqp.exceptions import PAMQPException
from pamqp.header import ContentHeader

READ_BYTES = 256 * 1024  # the most one read takes from the socket's buffer
# AMQP 0-9-1's frame layout, which worker/replies.py writes too: type, channel, payload size, payload, frame end
FRAME_HEAD = struct.Struct(">BHI")
FRAME_END = 0xCE
METHOD, HEADER, BODY = 1, 2, 3  # frame types
BASIC = 60  # the class of Basic's methods and of content headers
CONTENT_HEAD = struct.Struct(">HHQH")  # a content header's class, weight, body size, property flags
_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")
# tables and arrays inside one another beyond this depth read as None (no producer's headers need more; RabbitMQ
# passes any depth on)
MAX_NESTING = 64


class ChunkFrameReceiver(aiormq.connection.FrameReceiver):
    """aiormq's frame receiver, reading the socket in chunks (see the module doc)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        super().__init__(reader)
        self._buffer = bytearray()
        self._frames: deque[aiormq.connection.ReceivedFrame] = deque()  # (bytes, channel, frame), whole ones

    async def get_frame(self) -> aiormq.connection.ReceivedFrame:
        """The next frame as aiormq's receiver returns it; StopAsyncIteration once the connection ended
        between frames."""
        while not self._frames:
            async with self.lock:
                if not self._frames:
                    self._cut(await self._read())
        return self._frames.popleft()

    async def _read(self) -> bytes:
        try:
            chunk = await self.reader.read(READ_BYTES)
        except (ConnectionError, OSError) as e:
            raise AMQPConnectionError(f"Server communication error: {e!r}") from e
        if not chunk:
            if self._buffer:
                raise AMQPConnectionError(f"Server connection unexpectedly closed inside a frame: "
                                          f"{len(self._buffer)} bytes of it read")
            raise StopAsyncIteration
        return chunk

    def _cut(self, chunk: bytes) -> None:
        """Every whole frame of the buffer and `chunk`, decoded, into the queue; the rest stays buffered."""
        buffer = self._buffer
        buffer += chunk
        if not self.started and len(buffer) >= 4:
            if buffer.startswith(b"AMQP"):  # the server's own protocol header: it speaks another version
                raise ProtocolSyntaxError("Unexpected AMQP protocol header")
            self.started = True
        at = 0
        while len(buffer) - at >= FRAME_HEAD.size:
            _, _, size = FRAME_HEAD.unpack_from(buffer, at)
            end = at + FRAME_HEAD.size + size + 1
            if len(buffer) < end:
                break
            if buffer[end - 1] != FRAME_END:
                raise InvalidFrameError(f"a frame of {size} bytes does not end with the frame end octet")
            self._frames.append(decode_frame(bytes(buffer[at:end])))
            at = end
        del buffer[:at]


def decode_frame(data: bytes) -> aiormq.connection.ReceivedFrame:
    """One whole frame as pamqp.frame.unmarshal returns it, (its bytes, channel, frame); a job's frames decoded
    here, short strings that are not UTF-8 given U+FFFD (see the module doc). InvalidFrameError when it is none."""
    kind, channel, size = FRAME_HEAD.unpack_from(data)
    payload = data[FRAME_HEAD.size:FRAME_HEAD.size + size]
    try:
        if kind == BODY:
            return len(data), channel, ContentBody(payload)
        if kind == HEADER and size >= CONTENT_HEAD.size:
            return len(data), channel, _content_header(payload)
        if kind == METHOD and size >= 4:
            method = _METHODS.get(payload[:4])
            if method is not None:
                return len(data), channel, method(payload)
        return pamqp.frame.unmarshal(data)
    except PAMQPException as e:
        raise InvalidFrameError(str(e)) from e
    except (struct.error, ValueError, IndexError) as e:
        raise InvalidFrameError(f"Could not unmarshal frame of type {kind}: {e}") from e


def use_chunk_frames() -> None:
    """Make aiormq's connections opened from now on in this process read with ChunkFrameReceiver."""
    aiormq.connection.FrameReceiver = ChunkFrameReceiver  # type: ignore[misc]


def _short_string(data: bytes, at: int) -> tuple[str, int]:
    """pamqp's short string, U+FFFD for bytes that are not UTF-8; (value, where the next field starts)."""
    end = at + 1 + data[at]
    return data[at + 1:end].decode("utf-8", "replace"), end


def _octet(data: bytes, at: int) -> tuple[int, int]:
    return data[at], at + 1


def _timestamp(data: bytes, at: int) -> tuple[Any, int]:
    """pamqp's timestamp (a datetime in UTC), or None for one past what datetime holds."""
    if at + 8 > len(data):
        raise ValueError("Timestamp exceeds available data")
    try:
        return pamqp.decode.timestamp(data[at:at + 8])[1], at + 8
    except (ValueError, OverflowError, OSError):  # from datetime: a year past 9999
        return None, at + 8


def _sized(data: bytes, at: int, what: str) -> tuple[int, int]:
    """Where a table's or array's fields start and end (after its 4-byte size)."""
    (size,) = _U32.unpack_from(data, at)
    end = at + 4 + size
    if end > len(data):
        raise ValueError(f"Field {what} length exceeds available data")
    return at + 4, end


def _table(data: bytes, at: int, depth: int = 0) -> tuple[dict[str, Any] | None, int]:
    """pamqp's field table, names that are not UTF-8 given U+FFFD (values pamqp keeps as bytes already); None
    past MAX_NESTING."""
    at, end = _sized(data, at, "table")
    if depth > MAX_NESTING:
        return None, end
    table = {}
    while at < end:
        name, at = _short_string(data, at)
        if at > end:
            raise ValueError("Field table key length exceeds data")
        table[name], at = _field_value(data, at, depth)
    return table, at


def _array(data: bytes, at: int, depth: int) -> tuple[list[Any] | None, int]:
    at, end = _sized(data, at, "array")
    if depth > MAX_NESTING:
        return None, end
    values = []
    while at < end:
        value, at = _field_value(data, at, depth)
        values.append(value)
    return values, at


def _field_value(data: bytes, at: int, depth: int) -> tuple[Any, int]:
    """A table's or array's value: tables, arrays (their names may need U+FFFD) and timestamps here, the rest by
    pamqp."""
    kind = data[at:at + 1]
    if kind == b"F":
        return _table(data, at + 1, depth + 1)
    if kind == b"A":
        return _array(data, at + 1, depth + 1)
    if kind == b"T":
        return _timestamp(data, at + 1)
    consumed, value = pamqp.decode.embedded_value(data[at:])
    return value, at + consumed


# Basic.Properties in wire order: (flag, name, decoder), from pamqp's own flags and types
_DECODERS = {"shortstr": _short_string, "octet": _octet, "timestamp": _timestamp, "table": _table}
_PROPERTIES = [(flag, name, _DECODERS[getattr(spec.Basic.Properties, "_" + name)])
               for name, flag in spec.Basic.Properties.flags.items()]
# the properties a flags word sets, (name, decoder) in wire order: producers send a few such sets over and over
_PRESENT: dict[int, list[tuple[str, Any]]] = {}


def _present(flags: int) -> list[tuple[str, Any]]:
    present = _PRESENT.get(flags)
    if present is None:
        if flags & 1:  # more flag words: no Basic.Properties has them
            raise ValueError("continued property flags")
        if len(_PRESENT) >= 1024:
            _PRESENT.clear()
        present = _PRESENT[flags] = [(name, decode) for flag, name, decode in _PROPERTIES if flags & flag]
    return present


def _content_header(payload: bytes) -> ContentHeader:
    class_id, weight, body_size, flags = CONTENT_HEAD.unpack_from(payload)
    properties = spec.Basic.Properties()
    at = CONTENT_HEAD.size
    for name, decode in _present(flags):
        value, at = decode(payload, at)
        setattr(properties, name, value)
    header = ContentHeader(weight, body_size, properties)
    header.class_id = class_id
    return header


def _deliver(payload: bytes) -> spec.Basic.Deliver:
    """Basic.Deliver: consumer tag, delivery tag, redelivered (bit 0), exchange, routing key."""
    deliver = spec.Basic.Deliver()
    deliver.consumer_tag, at = _short_string(payload, 4)
    (deliver.delivery_tag,) = _U64.unpack_from(payload, at)
    deliver.redelivered = bool(payload[at + 8] & 1)
    deliver.exchange, at = _short_string(payload, at + 9)
    deliver.routing_key, _ = _short_string(payload, at)
    return deliver


def _ack(payload: bytes) -> spec.Basic.Ack:
    """Basic.Ack (a publish confirmed): delivery tag, multiple (bit 0)."""
    ack = spec.Basic.Ack()
    (ack.delivery_tag,) = _U64.unpack_from(payload, 4)
    ack.multiple = bool(payload[12] & 1)
    return ack


# methods decoded here, by their class and method ids (the payload's first four bytes)
_METHODS = {struct.pack(">HH", BASIC, 60): _deliver, struct.pack(">HH", BASIC, 80): _ack}
