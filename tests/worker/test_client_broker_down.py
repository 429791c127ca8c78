"""NllbClient while the broker cannot be reached, without touching the broker: the client talks to it through a
local TCP proxy that the test cuts, then makes refuse new connections (closed at once) or hold them silent (accepted,
never an AMQP byte). Oracle: the call's own timeout, measured."""
from __future__ import annotations

import asyncio
import contextlib
import time

import aio_pika
import pytest
from conftest import AMQP_URL, VHOST, run

from worker.client import BrokerUnavailable, NllbClient

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(120)]


class BrokerProxy:
    """A TCP proxy to the broker on 127.0.0.1:5672. `mode`: "forward", "refuse" or "silent" (for new connections);
    `cut()` aborts the connections through it."""

    def __init__(self) -> None:
        self.mode = "forward"
        self._sockets: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> BrokerProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        self.cut()

    @property
    def url(self) -> str:
        port = self._server.sockets[0].getsockname()[1]
        return f"amqp://guest:guest@127.0.0.1:{port}/{VHOST}"

    def cut(self) -> None:
        for writer in self._sockets:
            writer.transport.abort()
        self._sockets.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "refuse":
            writer.transport.abort()
            return
        self._sockets.add(writer)
        if self.mode == "silent":
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", 5672)
        self._sockets.add(up_writer)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.transport.abort()


async def declare_jobs_queue(name: str) -> None:
    """The jobs queue, with no worker on it."""
    connection = await aio_pika.connect(AMQP_URL)
    await (await connection.channel()).declare_queue(name, durable=True)
    await connection.close()


@pytest.mark.parametrize("mode", ["refuse", "silent"])
def test_translate_and_cancel_give_up_within_their_timeout_while_the_broker_is_unreachable(names, mode):
    async def body():
        await declare_jobs_queue(names["jobs_queue"])
        async with BrokerProxy() as proxy:
            client = NllbClient(proxy.url, names["jobs_queue"], reconnect_interval=0.2)
            await client.connect()
            proxy.mode = mode
            proxy.cut()
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            with pytest.raises(BrokerUnavailable) as raised:
                await client.translate(["hello"], "eng_Latn", "fra_Latn", timeout=2)
            assert 1.5 < time.monotonic() - t0 < 3.5
            assert raised.value.retryable and raised.value.code == "broker_unavailable"
            assert client.in_flight == 0
            t0 = time.monotonic()
            with pytest.raises(BrokerUnavailable):
                await client.cancel("some-job", timeout=2)
            assert time.monotonic() - t0 < 3.5
            await client.close()
    run(body(), 60)
