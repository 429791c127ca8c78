"""`overloaded`: the jobs queue at its length limit refuses jobs (x-overflow=reject-publish), and
the client surfaces it as QueueFull (code overloaded, retryable); an engine's Overloaded is
answered as a retryable error reply."""
from __future__ import annotations

import aio_pika
import pytest
from conftest import VHOST, rabbitmqctl, run
from helpers import PlainProducer, in_process_worker, job

from engine.errors import Overloaded
from worker.topology import declare_topology
from worker.client import NllbClient, QueueFull

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(60)]


def test_full_queue_refuses_jobs_client_raises_overloaded(settings, names, broker):
    policy = f"maxlen-{names['jobs_queue']}"
    pattern = "^" + names["jobs_queue"].replace(".", r"\.") + "$"
    rabbitmqctl("set_policy", "-p", VHOST, "--apply-to", "queues", policy, pattern, '{"max-length": 2}')
    try:
        async def body():
            conn = await aio_pika.connect(broker)
            await declare_topology(await conn.channel(), settings)  # no worker: jobs pile up
            await conn.close()
            async with NllbClient(broker, names["jobs_queue"]) as c:
                import asyncio
                for _ in range(50):  # the policy takes a moment to reach the queue
                    try:
                        await c.publish(c.job_body("x", "eng_Latn", "fra_Latn"))
                    except QueueFull as e:
                        assert e.code == "overloaded"
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError("the full queue never refused a job")
        run(body(), 50)
    finally:
        rabbitmqctl("clear_policy", "-p", VHOST, policy)


class OverloadedEngine:
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, texts, *a, **kw):
        if "BUSY" in texts[0]:
            raise Overloaded("injected: the engine refuses more work right now; retry later")
        return self.inner.submit(texts, *a, **kw)


def test_engine_overloaded_is_a_retryable_error_reply(settings, names, engine, broker):
    async def body():
        async with in_process_worker(settings, OverloadedEngine(engine)), \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            r = await p.one(job("BUSY"))
            assert r["status"] == "error" and r["error"] == {
                "code": "overloaded", "retryable": True,
                "message": "injected: the engine refuses more work right now; retry later"}
    run(body(), 50)
