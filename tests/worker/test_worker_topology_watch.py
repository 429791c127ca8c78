"""The topology while the worker runs (worker/topology.py, check_topology): what someone deletes is declared
again, so dead letters and cancels keep their way; a jobs queue declared anew with other arguments is not
consumed (the worker is not ready) until it matches again."""
from __future__ import annotations

import asyncio
import uuid

import aio_pika
import aiormq
import pytest
from conftest import VHOST, queue_counts, rabbitmqctl, run
from helpers import PlainProducer, eventually, in_process_worker, job
from structlog.testing import capture_logs
from test_worker_control_reconnect import connection_pids

from worker import amqp

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(120)]

CHECK_S = 0.3


@pytest.fixture
def watched(settings, monkeypatch):
    """The worker's settings with a control exchange of the test's own, its topology checked every CHECK_S."""
    monkeypatch.setattr(amqp, "TOPOLOGY_CHECK_S", CHECK_S)
    return settings.model_copy(update={"control_exchange": f"nllb.test.control.{uuid.uuid4().hex[:8]}"})


async def declare_classic(conn: aio_pika.abc.AbstractConnection, name: str) -> None:
    """Delete queue `name` and declare it as a classic queue without arguments, as an operator might; again while
    the worker puts its own back first (PRECONDITION_FAILED for ours)."""
    for _ in range(20):
        ch = await conn.channel()
        await ch.queue_delete(name)
        try:
            await ch.declare_queue(name, durable=True)
            await ch.close()
            return
        except aiormq.exceptions.ChannelPreconditionFailed:
            await asyncio.sleep(0.05)
    raise AssertionError("the worker's quorum queue came back before every classic declaration")


def test_a_jobs_queue_declared_anew_otherwise_is_not_consumed_until_it_matches_again(watched, names, engine,
                                                                                       broker):
    async def body():
        async with in_process_worker(watched, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            assert (await p.one(job("hello world")))["status"] == "ok"
            await declare_classic(p.conn, names["jobs_queue"])
            await eventually(lambda: svc.broker.topology_error is not None, 10, "the mismatch seen")
            assert "x-queue-type" in svc.broker.topology_error or "x-dead-letter" in svc.broker.topology_error
            assert not svc.ready()
            cid = await p.publish(job("hello world"))
            await asyncio.sleep(1.0)
            assert cid not in p.replies and queue_counts(names["jobs_queue"]) == (1, 0), "a classic queue consumed"

            ch = await p.conn.channel()
            await ch.queue_delete(names["jobs_queue"])  # the job in it goes with it
            await eventually(lambda: svc.ready(), 10, "the quorum queue declared again and consumed")
            assert (await p.one(job("hello world")))["status"] == "ok"
    run(body(), 90)


def test_a_dead_letter_queue_deleted_while_the_worker_runs_is_declared_again_and_gets_the_dead_letters(
        watched, names, engine, broker):
    async def body():
        async with in_process_worker(watched, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            ch = await p.conn.channel()
            await ch.queue_delete(names["dead_letter_queue"])
            await asyncio.sleep(3 * CHECK_S)
            await p.publish(job("no reply_to"), reply=False, message_id="unanswerable")
            dead = await p.dead_letters(names["dead_letter_queue"], 1, 20)
            assert [m.message_id for m in dead] == ["unanswerable"]
            assert svc.ready() and svc.broker.topology_error is None
    run(body(), 90)


def test_a_control_exchange_declared_anew_is_bound_again_and_cancels_reach_the_worker(watched, names, engine,
                                                                                        broker):
    async def body():
        async with in_process_worker(watched, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            ch = await p.conn.channel()
            await ch.exchange_delete(watched.control_exchange)  # its bindings go with it
            exchange = await ch.declare_exchange(watched.control_exchange, aio_pika.ExchangeType.FANOUT,
                                                 durable=True)
            await asyncio.sleep(3 * CHECK_S)
            await exchange.publish(aio_pika.Message(b'{"v": 1, "cancel": "to-cancel"}'), routing_key="")
            await eventually(lambda: svc.cancellations.cancelled("to-cancel"), 10, "the cancel received")
            r = await p.one(job("hello world", id="to-cancel"))
            assert r["status"] == "error" and r["error"]["code"] == "cancelled"
            await ch.exchange_delete(watched.control_exchange)
    run(body(), 90)


def test_a_worker_whose_consumer_is_gone_and_cannot_come_back_is_not_ready(watched, names, engine, broker):
    """The broker cancels the consumer (its queue deleted) while the worker may not declare (its configure
    permission taken away): it cannot consume again, so it must not say it is ready; it consumes again once the
    permission is back."""
    async def body():
        async with in_process_worker(watched, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            assert svc.ready()
            rabbitmqctl("set_permissions", "-p", VHOST, "guest", "^$", ".*", ".*")
            try:
                rabbitmqctl("delete_queue", "-p", VHOST, names["jobs_queue"])
                await eventually(lambda: not svc.ready(), 10, "not ready")
                await asyncio.sleep(3 * CHECK_S)
                assert not svc.ready()
            finally:
                rabbitmqctl("set_permissions", "-p", VHOST, "guest", ".*", ".*", ".*")
            await eventually(lambda: svc.ready(), 10, "ready again")
            assert (await p.one(job("hello world")))["status"] == "ok"
    run(body(), 90)


def test_a_connection_lost_while_the_jobs_queue_is_declared_otherwise_reconnects_once(watched, names, engine,
                                                                                        broker):
    """The queues are declared on a channel of their own, not on the robust consuming channel, whose reopening
    would declare them again: with the jobs queue declared otherwise that failed every reconnection, and the
    worker reconnected in a loop, every NLLB_RECONNECT_INTERVAL_S."""
    async def body():
        async with in_process_worker(watched, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            await declare_classic(p.conn, names["jobs_queue"])
            await eventually(lambda: svc.broker.topology_error is not None, 10, "the mismatch seen")
            pid, = await asyncio.to_thread(connection_pids, "test-inproc")
            with capture_logs() as logs:
                await asyncio.to_thread(rabbitmqctl, "close_connection", pid, "test: a lost connection")
                await asyncio.sleep(10 * watched.reconnect_interval_s)
            lost = [x for x in logs if x["event"] == "broker connection lost; reconnecting"]
            assert len(lost) == 1 and svc.metrics.reconnects._value.get() == 1
            assert not svc.ready()
            ch = await p.conn.channel()
            await ch.queue_delete(names["jobs_queue"])
            await eventually(lambda: svc.ready(), 10, "ready once the queue is declared again")
            assert (await p.one(job("hello world")))["status"] == "ok"
    run(body(), 90)


def test_consuming_again_is_retried_soon_when_its_first_try_fails_not_at_the_next_topology_check(
        settings, names, engine, broker):
    """Just after a reconnection the robust connection may not have declared the exclusive control queue anew when
    the consumer is made again, and the check's bind of it fails (NOT_FOUND): the try is made again within a few
    reconnect intervals, not TOPOLOGY_CHECK_S (30 s) later, when a process would have consumed nothing meanwhile."""
    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            assert (await p.one(job("hello world")))["status"] == "ok"
            b = svc.broker
            channel = await b._consume_ch.get_underlay_channel()
            await channel.basic_cancel(b.consumer_tag)  # the consumer gone, as with the old connection
            control = b.control_queue.name
            await b.control_queue.delete(if_unused=False, if_empty=False)  # not declared anew yet
            with capture_logs() as logs:
                b._consume_again()
                await eventually(lambda: any(x.get("retry_in_s") for x in logs), 10, "a failed try")
                assert not svc.ready()
                await b._control_ch.declare_queue(control, exclusive=True, auto_delete=True)
                await eventually(svc.ready, 5 * settings.reconnect_interval_s + 2, "consuming again")
            assert amqp.TOPOLOGY_CHECK_S == 30.0
            failed = [x for x in logs if x["event"] == "consuming again failed; trying again"]
            assert failed and "NOT_FOUND" in failed[0]["error"]
            assert (await p.one(job("hello world")))["status"] == "ok"
    run(body(), 90)
