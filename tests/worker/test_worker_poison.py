"""A job whose processing fails on every delivery is dead-lettered after the delivery limit;
the worker keeps serving the others meanwhile."""
from __future__ import annotations


import aiormq
import pytest
from conftest import run, settled_counts
from helpers import PlainProducer, eventually, in_process_worker, job

from engine.errors import EngineFailure

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(120)]


class PoisonedEngine:
    """The real engine, except that a segment containing POISON fails the engine every time."""

    def __init__(self, inner):
        self.inner = inner
        self.poison_attempts = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, texts, *args, **kwargs):
        if any("POISON" in t for t in texts):
            self.poison_attempts += 1
            raise EngineFailure("injected: the engine fails on this job every time")
        return self.inner.submit(texts, *args, **kwargs)


class UntypedFailureEngine(PoisonedEngine):
    """An engine bug (an untyped exception) on one input: answered `internal`, retryable."""

    def submit(self, texts, *args, **kwargs):
        if any("BUG" in t for t in texts):
            raise ZeroDivisionError("injected engine bug")
        return self.inner.submit(texts, *args, **kwargs)


def settlements_sent(monkeypatch) -> list[tuple[str, bool]]:
    """Every basic.reject / basic.nack the worker sends, as (method, requeue), each still sent to the broker."""
    sent: list[tuple[str, bool]] = []
    for method in ("basic_reject", "basic_nack"):
        def spy(self, delivery_tag, *args, _method=method, _real=getattr(aiormq.Channel, method), **kw):
            sent.append((_method, kw.get("requeue", True)))
            return _real(self, delivery_tag, *args, **kw)
        monkeypatch.setattr(aiormq.Channel, method, spy)
    return sent


def test_poison_message_is_dead_lettered_after_delivery_limit(settings, names, engine, broker, monkeypatch):
    """A failed attempt goes back by basic.reject with requeue: RabbitMQ 4.3 and later count only that (not a
    nack) toward the delivery limit, so a nack would send the job round forever there. The local broker counts
    both, so the test also checks which method went out."""
    eng = PoisonedEngine(engine)
    sent = settlements_sent(monkeypatch)

    async def body():
        async with in_process_worker(settings, eng) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            poison = await p.publish(job("POISON pill"), message_id="poison")
            good = [await p.publish(job(f"hello world {i}")) for i in range(20)]
            await p.wait_for(good, 60)
            assert all(p.replies[c][0]["status"] == "ok" for c in good)
            dead = await p.dead_letters(names["dead_letter_queue"], 1, 30)
            assert dead, "the poison message never reached the dead-letter queue"
            assert dead[0].message_id == "poison"
            assert dead[0].headers["x-death"][0]["reason"] == "delivery_limit"
            assert poison not in p.replies  # never answered: it's a dead letter
            assert eng.poison_attempts == settings.delivery_limit + 1
            await eventually(lambda: svc.metrics.count("requeue", "engine_failure") == eng.poison_attempts)
            assert sent == [("basic_reject", True)] * eng.poison_attempts
            # still serving
            assert (await p.one(job("after the poison")))["status"] == "ok"
        assert settled_counts(names["jobs_queue"]) == (0, 0)
    run(body(), 110)


def test_untyped_engine_error_is_answered_internal(settings, names, engine, broker):
    eng = UntypedFailureEngine(engine)

    async def body():
        async with in_process_worker(settings, eng), \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            r = await p.one(job("BUG here"))
            assert r["status"] == "error" and r["error"]["code"] == "internal"
            assert r["error"]["retryable"] is True
            assert (await p.one(job("hello")))["status"] == "ok"
    run(body(), 60)
