"""The worker's control consumer survives a reconnection: the broker closes the worker's connection
(that one only, found by its connection name in the tests' vhost), the robust connection comes
back with its channels, and a cancel published afterwards still reaches a running job."""
from __future__ import annotations

import asyncio
import uuid

import pytest
from conftest import VHOST, rabbitmqctl, run
from helpers import PlainProducer, eventually

from engine import Engine
from tests.worker.test_worker_cancel import SLOW, doc_job, long_document, send_control
from worker.metrics import Metrics
from worker.service import Service

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(180)]


def connection_pids(name: str) -> list[str]:
    """The broker's pids of the tests' vhost connections whose connection_name is `name`."""
    out = rabbitmqctl("list_connections", "-p", VHOST, "-q", "--no-table-headers", "pid", "client_properties")
    rows = [line.split("\t", 1) for line in out.splitlines() if "\t" in line]
    return [pid for pid, properties in rows if f'{{"connection_name","{name}"}}' in properties]


def test_control_consumer_survives_a_connection_closed_by_the_broker(settings, names, toy_dir, broker):
    eng = Engine.load(toy_dir, device="cpu", max_rows=8)
    name = f"test-reconnect-{uuid.uuid4().hex[:8]}"

    async def body():
        svc = Service(settings, eng, Metrics(), name=name, owns_engine=False)
        await svc.start()
        try:
            async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
                before, = await asyncio.to_thread(connection_pids, name)
                await asyncio.to_thread(rabbitmqctl, "close_connection", before, "test: control reconnect")
                await eventually(lambda: svc.metrics.reconnects._value.get() == 1, 30, "the reconnection")
                after = await asyncio.to_thread(connection_pids, name)
                assert len(after) == 1 and after != [before]  # one connection: the new one
                d = doc_job(long_document(4, 200), options=SLOW)
                cid = await p.publish(d)
                await eventually(lambda: eng.stats().rows_used == eng.rows_total, 30, "the document decoding")
                await send_control(broker, settings.control_exchange, {"v": 1, "cancel": d["id"]})
                await p.wait_for([cid], 10)
                r, = p.replies[cid]
                assert r["id"] == d["id"] and r["error"]["code"] == "cancelled"
                assert svc.metrics.cancellations.labels("running")._value.get() == 1
                await eventually(lambda: eng.stats().rows_used == 0, 5, "the rows freed")
        finally:
            svc.stop()
            await svc.shutdown()
    try:
        run(body(), 150)
    finally:
        eng.close()
