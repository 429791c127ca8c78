"""Cancellation through the `nllb.control` fanout exchange, real broker, toy engines: a running
document, a job waiting for rows, a cancel that comes before its job, an unknown id, malformed
control messages, and two workers on one queue. Oracles: the replies, and the engines' own
stats (rows freed, jobs cancelled)."""
from __future__ import annotations

import json
import random
import time

import aio_pika
import pytest
from conftest import run
from helpers import PlainProducer, eventually, in_process_worker, job

from engine import Engine
from tests.fixtures.make_toy import sample_sentence
from worker.control import CancelMemory

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(180)]

SLOW = {"min_new_tokens": 150, "max_new_tokens": 160}  # every segment decodes 150 steps at least


def long_document(seed: int, sentences: int) -> str:
    rng = random.Random(seed)
    return "\n".join(f"{sample_sentence(rng)}." for _ in range(sentences))


def doc_job(text: str, **kw) -> dict:
    body = job("x", **kw)
    del body["text"]
    body["document"] = text
    return body


async def send_control(url: str, exchange: str, body: dict | bytes) -> None:
    conn = await aio_pika.connect(url)
    try:
        ch = await conn.channel(publisher_confirms=True)
        ex = await ch.get_exchange(exchange, ensure=True)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        await ex.publish(aio_pika.Message(data, content_type="application/json"), routing_key="")
    finally:
        await conn.close()


@pytest.fixture
def small_engine(toy_dir):
    eng = Engine.load(toy_dir, device="cpu", max_rows=8)
    yield eng
    eng.close()


def test_cancel_of_a_running_document_answers_cancelled_and_frees_its_rows(settings, names, small_engine,
                                                                           broker):
    eng = small_engine

    async def body():
        async with in_process_worker(settings, eng) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            d = doc_job(long_document(1, 200), options=SLOW)
            cid = await p.publish(d)
            await eventually(lambda: eng.stats().rows_used == eng.rows_total, 30, "the document decoding")
            t0 = time.monotonic()
            await send_control(broker, settings.control_exchange, {"v": 1, "cancel": d["id"]})
            await p.wait_for([cid], 10)
            assert time.monotonic() - t0 < 1.0
            r, = p.replies[cid]
            assert r["id"] == d["id"] and r["error"]["code"] == "cancelled" and r["error"]["retryable"] is False
            await eventually(lambda: eng.stats().cancelled_jobs == 1, 5, "the engine's stats")
            assert eng.stats().rows_freed_by_cancel == eng.rows_total
            assert svc.metrics.cancellations.labels("running")._value.get() == 1
            nxt = await p.one(job("rema sila"), timeout=30)  # the next job is served
            assert nxt["translations"][0]["text"] == eng.translate(["rema sila"], "eng_Latn", "fra_Latn")[0].text
            await eventually(lambda: svc.metrics.rows_freed_by_cancel._value.get() == eng.rows_total, 5,
                             "the rows-freed gauge")
    run(body(), 120)


def test_cancel_of_a_waiting_job_and_of_a_job_not_yet_delivered(settings, names, toy_dir, broker):
    eng = Engine.load(toy_dir, device="cpu", max_rows=1)
    settings = settings.model_copy(update={"prefetch": 6})

    async def body():
        async with in_process_worker(settings, eng) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            # three blockers take the one row in turn (~0.2 s each, first come first served): the victim waits
            # behind all of them, long enough for its cancel to cross the broker on a loaded machine
            blockers = [job("rema sila to", options={"min_new_tokens": 240, "max_new_tokens": 250})
                        for _ in range(3)]
            victim = job("rema sila")
            cids = [await p.publish(j) for j in blockers] + [await p.publish(victim)]
            await eventually(lambda: eng.stats().jobs_waiting == 3, 30, "the victim waiting behind two blockers")
            await send_control(broker, settings.control_exchange, {"v": 1, "cancel": victim["id"]})
            await p.wait_for(cids[3:], 10)
            assert p.replies[cids[3]][0]["error"]["code"] == "cancelled"
            await eventually(lambda: eng.stats().cancelled_jobs == 1, 5, "the engine's stats")
            assert eng.stats().rows_freed_by_cancel == 0  # it never took rows
            assert svc.metrics.cancellations.labels("waiting")._value.get() == 1

            early = job("rema")  # its cancel comes first
            await send_control(broker, settings.control_exchange, {"v": 1, "cancel": early["id"]})
            await eventually(lambda: svc.cancellations.cancelled(early["id"]), 5, "the cancel remembered")
            r = await p.one(early, timeout=10)
            assert r["error"]["code"] == "cancelled" and "before it arrived" in r["error"]["message"]
            assert svc.metrics.cancellations.labels("arrived")._value.get() == 1
            await p.wait_for(cids[:3], 60)
            assert all(p.replies[c][0]["status"] == "ok" for c in cids[:3])
            assert eng.stats().cancelled_jobs == 1  # the early one never reached the engine
    try:
        run(body(), 120)
    finally:
        eng.close()


def test_unknown_ids_and_malformed_control_messages_change_nothing(settings, names, engine, broker):
    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            before = engine.stats().cancelled_jobs
            for bad in (b"{nope", b"[1]", {"v": 2, "cancel": "x"}, {"cancel": ""}, {"cancel": 7},
                        b'{"cancel": "\\ud800"}', {"v": 1}, {"v": 1, "cancel": "x" * 8000}, {"v": True, "cancel": "t"}):
                await send_control(broker, settings.control_exchange, bad)
            await send_control(broker, settings.control_exchange, {"v": 1, "cancel": "no-such-job"})
            await eventually(lambda: svc.cancellations.cancelled("no-such-job"), 5, "the cancel handled")
            assert len(svc.cancellations.memory) == 1  # the malformed ones were dropped
            r = await p.one(job("rema sila"))
            assert r["status"] == "ok"
            assert engine.stats().cancelled_jobs == before
            assert all(svc.metrics.cancellations.labels(stage)._value.get() == 0
                       for stage in ("arrived", "waiting", "running"))
            assert svc.broker.consuming()
    run(body(), 60)


def test_two_workers_on_one_queue_the_holder_cancels(settings, names, engine, small_engine, broker):
    async def body():
        async with in_process_worker(settings, engine) as a, in_process_worker(settings, small_engine) as b, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            d = doc_job(long_document(2, 400), options=SLOW)
            cid = await p.publish(d)
            await eventually(lambda: any(e.stats().rows_used > 0 for e in (engine, small_engine)), 30,
                             "the document decoding")
            holder, other = (a, b) if engine.stats().rows_used > 0 else (b, a)
            await send_control(broker, settings.control_exchange, {"v": 1, "cancel": d["id"]})
            await p.wait_for([cid], 5)
            assert p.replies[cid][0]["error"]["code"] == "cancelled"
            assert holder.metrics.cancellations.labels("running")._value.get() == 1
            assert other.metrics.cancellations.labels("running")._value.get() == 0
            assert other.cancellations.cancelled(d["id"])  # the other remembers it, should it come later
    run(body(), 120)


def test_cancel_memory_forgets_after_its_time_and_keeps_at_most_its_size():
    memory = CancelMemory(memory_s=0.2, max_ids=3)
    for i in range(5):
        memory.add(f"j{i}")
    assert [f"j{i}" in memory for i in range(5)] == [False, False, True, True, True]
    time.sleep(0.25)
    assert len(memory) == 0 and "j4" not in memory
    memory.add("j1")
    memory.add("j1")
    assert len(memory) == 1
