"""NllbClient's reply handling against a scripted worker (the test consumes the jobs queue and publishes what it
is told to the job's reply_to, through the real broker): malformed final replies, unknown interim statuses, a
correlation id used twice, and the bounded memory of answered ids and pending jobs."""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

import aio_pika
import pytest
from conftest import AMQP_URL, run

from worker import client as client_module
from worker.client import MalformedReply, NllbClient
from worker.messages import OkReply

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(60)]


def ok(job_id: str) -> bytes:
    return json.dumps({"v": 1, "id": job_id, "status": "ok", "translations": [{"text": f"T-{job_id}"}],
                       "src_lang": "eng_Latn", "tgt_lang": "fra_Latn", "model": "toy",
                       "usage": {"src_tokens": 1, "tgt_tokens": 1},
                       "timings_ms": {"queued": 1.0, "compute": 1.0}}).encode()


class ScriptedWorker:
    """Consumes the jobs queue; `script(job body)` gives the reply bodies to send to each job, in order. `jobs`:
    every job message taken."""

    def __init__(self, jobs_queue: str, script: Callable[[dict[str, Any]], list[bytes]]) -> None:
        self.jobs_queue, self.script = jobs_queue, script
        self.jobs: list[aio_pika.abc.AbstractIncomingMessage] = []

    async def __aenter__(self) -> ScriptedWorker:
        self._connection = await aio_pika.connect(AMQP_URL)
        self._channel = await self._connection.channel()
        queue = await self._channel.declare_queue(self.jobs_queue, durable=True)
        await queue.consume(self._on_job)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._connection.close()

    async def _on_job(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        await message.ack()
        self.jobs.append(message)
        for body in self.script(json.loads(message.body)):
            await self.reply(message, body)

    async def reply(self, job: aio_pika.abc.AbstractIncomingMessage, body: bytes) -> None:
        await self._channel.default_exchange.publish(aio_pika.Message(body, correlation_id=job.correlation_id),
                                                     routing_key=job.reply_to)


async def eventually_true(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.02)


MALFORMED = {
    "not JSON": b"\xff not json",
    "a JSON list": b"[1, 2]",
    "ok without its fields": b'{"v": 1, "id": "j", "status": "ok"}',
    "error without its error": b'{"v": 1, "id": "j", "status": "error"}',
    "another major version": ok("j").replace(b'"v": 1', b'"v": 2'),
}


@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_final_reply_fails_the_job_with_malformed_reply(names, body):
    async def test():
        async with ScriptedWorker(names["jobs_queue"], lambda job: [body]), \
                NllbClient(AMQP_URL, names["jobs_queue"]) as client:
            with pytest.raises(MalformedReply) as raised:
                await client.translate(["x"], "eng_Latn", "fra_Latn", timeout=10)
            kept = body[:client_module.MAX_MALFORMED_BYTES]  # the last case is longer
            assert raised.value.body == kept and repr(kept) in str(raised.value)
            assert raised.value.code == "malformed_reply" and not raised.value.retryable
            assert (client.replies, client.in_flight) == (1, 0)
    run(test(), 30)


def test_a_message_of_unknown_status_is_ignored_and_the_final_reply_answers(names):
    def script(job: dict[str, Any]) -> list[bytes]:
        return [json.dumps({"v": 1, "id": job["id"], "status": "queued"}).encode(), ok(job["id"])]

    async def test():
        async with ScriptedWorker(names["jobs_queue"], script), NllbClient(AMQP_URL, names["jobs_queue"]) as client:
            reply = await client.translate(["x"], "eng_Latn", "fra_Latn", job_id="j1", timeout=10)
            assert isinstance(reply, OkReply) and reply.translations[0].text == "T-j1"
            assert (client.ignored, client.replies, client.duplicates) == (1, 1, 0)
    run(test(), 30)


def test_publish_refuses_a_correlation_id_still_pending(names):
    async def test():
        async with ScriptedWorker(names["jobs_queue"], lambda job: []) as worker, \
                NllbClient(AMQP_URL, names["jobs_queue"]) as client:
            first = await client.publish(NllbClient.job_body(["a"], job_id="job-1"), correlation_id="order-7")
            with pytest.raises(ValueError, match="order-7"):
                await client.publish(NllbClient.job_body(["b"], job_id="job-2"), correlation_id="order-7")
            await eventually_true(lambda: len(worker.jobs) == 1)
            await worker.reply(worker.jobs[0], ok("job-1"))
            assert (await client.wait(first, 10)).id == "job-1"
            again = await client.publish(NllbClient.job_body(["b"], job_id="job-2"), correlation_id="order-7")
            await eventually_true(lambda: len(worker.jobs) == 2)
            await worker.reply(worker.jobs[1], ok("job-2"))
            assert (await client.wait(again, 10)).id == "job-2"
    run(test(), 30)


def test_answered_ids_are_remembered_up_to_max_answered(names, monkeypatch):
    monkeypatch.setattr(client_module, "MAX_ANSWERED", 2)

    async def test():
        async with ScriptedWorker(names["jobs_queue"], lambda job: [ok(job["id"])]) as worker, \
                NllbClient(AMQP_URL, names["jobs_queue"]) as client:
            for i in range(3):
                await client.translate(["x"], job_id=f"j{i}", timeout=10)
            await worker.reply(worker.jobs[0], ok("j0"))  # forgotten: the oldest of three
            await eventually_true(lambda: client.late == 1)
            await worker.reply(worker.jobs[2], ok("j2"))
            await eventually_true(lambda: client.duplicates == 1)
            assert len(client._answered) == 2
    run(test(), 30)


def test_a_done_future_leaves_nothing_pending_however_it_is_awaited(names):
    async def test():
        async with ScriptedWorker(names["jobs_queue"], lambda job: [] if job["id"] == "never" else [ok(job["id"])]), \
                NllbClient(AMQP_URL, names["jobs_queue"]) as client:
            answered = await client.publish(NllbClient.job_body(["x"], job_id="j1"), on_progress=print)
            assert (await answered).id == "j1"  # awaited directly, not through wait()
            unanswered = await client.publish(NllbClient.job_body(["x"], job_id="never"), on_progress=print)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(unanswered, 0.2)
            await asyncio.sleep(0)
            assert client.in_flight == 0 and client._progress == {}
    run(test(), 30)
