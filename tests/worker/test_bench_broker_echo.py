"""bench/broker_echo.py, the broker's own ceiling for the worker's message flow, through the real broker: every job
is answered once, to its reply_to with its correlation id, and acknowledged (the queue ends empty
with nothing unacked); and `bench.worker_rate --broker-only` counts those answers as it counts the worker's."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import aio_pika
import orjson
from conftest import ROOT, settled_counts, worker_env

from bench import worker_rate
from worker.topology import declare_topology


async def publish_and_collect(url: str, settings, n: int, timeout: float = 60.0) -> list[str]:
    """Publish n jobs to the jobs queue, each with its own correlation id; the ids of the replies, in arrival
    order, once n came (or the timeout passed)."""
    conn = await aio_pika.connect(url)
    try:
        channel = await conn.channel(publisher_confirms=True)
        await declare_topology(channel, settings)
        replies = await channel.declare_queue(exclusive=True)
        got: list[str] = []
        done = asyncio.Event()

        async def on_reply(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with message.process():
                assert orjson.loads(message.body)["status"] == "ok"
                got.append(message.correlation_id)
                if len(got) == n:
                    done.set()

        await replies.consume(on_reply)
        await asyncio.gather(*(channel.default_exchange.publish(
            aio_pika.Message(b'{"v": 1}', reply_to=replies.name, correlation_id=f"c{i}"),
            routing_key=settings.jobs_queue) for i in range(n)))
        await asyncio.wait_for(done.wait(), timeout)
        return got
    finally:
        await conn.close()


def test_echo_answers_each_job_once_and_acks_every_delivery(broker, settings, names):
    echo = subprocess.Popen([sys.executable, "-m", "bench.broker_echo", "--processes", "2", "--prefetch", "50"],
                            cwd=ROOT, env=worker_env(names))
    try:
        got = asyncio.run(publish_and_collect(broker, settings, 600))
        assert sorted(got) == sorted(f"c{i}" for i in range(600))
        assert settled_counts(names["jobs_queue"]) == (0, 0), "every delivery acknowledged"
    finally:
        echo.terminate()
        assert echo.wait(30) == 0


def test_worker_rate_broker_only_counts_every_answer_once(broker):
    result = asyncio.run(worker_rate.measure(broker, 400, 2, broker_processes=2, broker_only=True))
    assert result["jobs"] == 400 and result["errors"] == 0 and result["duplicates"] == 0
    assert result["jobs_per_s"] > 0
