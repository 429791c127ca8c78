"""AMQP frames read from the socket in chunks: the worker's connections read with `ChunkFrameReceiver`.

aiormq's `FrameReceiver` reads every frame with three awaited `readexactly` calls (type, header, payload) under
a lock, into a `BytesIO` of its own: a delivery is three frames and a confirm one more, so ~13 awaits and their
objects a job, which took the event loop ~7% of its time a job on the 2-core machine. `ChunkFrameReceiver`
reads whatever the socket holds (one await), cuts every whole frame out of it and hands them out one by one,
each decoded by pamqp as aiormq decodes it. Errors are aiormq's: `AMQPConnectionError` when the connection
ends inside a frame or fails, `InvalidFrameError` for a frame that is not one, `ProtocolSyntaxError` when the
server answers the protocol header with its own.

`use_chunk_frames()` makes aiormq's connections made afterwards in this process read this way (aiormq makes
its receiver by the module-level name `aiormq.connection.FrameReceiver`, aiormq 7.2); tests/worker runs every
frame the worker reads through it, and test_frames.py holds it to aiormq's own receiver over split and
joined reads.
"""
from __future__ import annotations

import asyncio
import struct
from collections import deque

import aiormq.connection
import pamqp.frame
from aiormq.exceptions import AMQPConnectionError, InvalidFrameError, ProtocolSyntaxError
from pamqp.exceptions import PAMQPException

READ_BYTES = 256 * 1024  # the most one read takes from the socket's buffer
_HEAD = struct.Struct(">BHI")  # frame type, channel, payload size
_FRAME_END = 0xCE


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
        while len(buffer) - at >= _HEAD.size:
            _, _, size = _HEAD.unpack_from(buffer, at)
            end = at + _HEAD.size + size + 1
            if len(buffer) < end:
                break
            if buffer[end - 1] != _FRAME_END:
                raise InvalidFrameError(f"a frame of {size} bytes does not end with the frame end octet")
            try:
                self._frames.append(pamqp.frame.unmarshal(bytes(buffer[at:end])))
            except PAMQPException as e:
                raise InvalidFrameError(str(e)) from e
            at = end
        del buffer[:at]


def use_chunk_frames() -> None:
    """Make aiormq's connections opened from now on in this process read with ChunkFrameReceiver."""
    aiormq.connection.FrameReceiver = ChunkFrameReceiver  # type: ignore[misc]
