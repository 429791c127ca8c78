"""Fault tests with `python -m worker run` subprocesses against the real broker: kill -9,
closed connections, a broker restart, SIGTERM. Every job is counted by id: 0 missing."""
from __future__ import annotations

import asyncio
import subprocess

import pytest
from conftest import queue_counts, rabbitmqctl, run, wait_broker
from helpers import PlainProducer, eventually, job

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

SLOW = {"num_beams": 4, "min_new_tokens": 80, "max_new_tokens": 80}


def slow_job(i: int) -> dict:
    return job([f"the cat sat on the mat {i}", f"hello world {i}"], options=SLOW, id=f"job-{i}")


async def settle_counts(names, want=(0, 0), timeout=30.0):
    loop = asyncio.get_running_loop()
    t_end = loop.time() + timeout
    while True:
        counts = await asyncio.to_thread(queue_counts, names["jobs_queue"])
        if counts == want or loop.time() > t_end:
            return counts
        await asyncio.sleep(0.5)


@pytest.mark.timeout(240)
def test_kill9_with_jobs_in_flight_second_worker_answers_all(names, spawn, broker):
    n = 40
    a = spawn("a", NLLB_MAX_ROWS=8)
    a.wait_ready()

    async def body():
        async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            cids = [await p.publish(slow_job(i), cid=f"job-{i}") for i in range(n)]
            await eventually(lambda: len(p.replies) >= 2, 120, "first replies")
            assert len(p.replies) < n, "the jobs finished before the kill; make them slower"
            a.kill9()
            answered_by_a = len(p.replies)
            b = spawn("b", NLLB_MAX_ROWS=8)
            await asyncio.to_thread(b.wait_ready)
            await p.wait_for(cids, 180)
            missing = [c for c in cids if c not in p.replies]
            dups = sum(len(v) - 1 for v in p.replies.values())
            print(f"\nkill -9: {answered_by_a} answered before the kill, {n - answered_by_a} after; "
                  f"missing {len(missing)}, duplicates {dups}")
            assert not missing
            assert all(p.replies[c][0]["status"] == "ok" for c in cids)
            assert await settle_counts(names) == (0, 0)
            assert b.terminate() == 0
    run(body(), 230)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["close_all_connections", "broker_restart"])
def test_worker_reconnects_by_itself(names, spawn, broker, fault):
    n = 60
    w = spawn("w", NLLB_MAX_ROWS=8)
    w.wait_ready()

    async def body():
        async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            cids = [await p.publish(slow_job(i), cid=f"job-{i}") for i in range(n)]
            await eventually(lambda: len(p.replies) >= 3, 120, "first replies")
            before = len(p.replies)
            if fault == "close_all_connections":
                await asyncio.to_thread(rabbitmqctl, "close_all_connections", "test")
            else:
                await asyncio.to_thread(rabbitmqctl, "stop_app")
                await asyncio.sleep(2)
                await asyncio.to_thread(rabbitmqctl, "start_app")
                await asyncio.to_thread(wait_broker, 60)
            await p.wait_for(cids, 200)
            missing = [c for c in cids if c not in p.replies]
            dups = sum(len(v) - 1 for v in p.replies.values())
            stale = w.count("delivery stale: its channel closed, the broker requeued it; it will be answered again")
            print(f"\n{fault}: {before} answered before, missing {len(missing)}, duplicates {dups}, stale acks {stale}")
            assert not missing
            assert w.proc.poll() is None, "the worker died"
            assert w.count("reconnected to the broker; consuming resumes") >= 1
            status, _ = await asyncio.to_thread(w.http, "/readyz")
            assert status == 200
            assert await settle_counts(names) == (0, 0)
            assert w.terminate() == 0
    run(body(), 230)


@pytest.mark.timeout(240)
def test_sigterm_drains_or_requeues_exit_0(names, spawn, broker):
    n = 30
    a = spawn("a", NLLB_MAX_ROWS=8, NLLB_DRAIN_TIMEOUT_S=0.2)  # shorter than the ~8 prefetched jobs take
    a.wait_ready()

    async def body():
        async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            cids = [await p.publish(slow_job(i), cid=f"job-{i}") for i in range(n)]
            await eventually(lambda: len(p.replies) >= 1, 120, "first reply")
            rc = await asyncio.to_thread(a.terminate, 60)
            assert rc == 0
            requeued = a.count("job settled", outcome="requeue")
            ok_a = a.count("job settled", outcome="ok")
            assert requeued >= 1, "nothing was in flight at SIGTERM; make the jobs slower"
            assert a.count("stopped") == 1
            # nothing lost: the rest is still in the queue, ready, for the next worker
            ready, unacked = await settle_counts(names, (n - len(p.replies), 0), 15)
            assert unacked == 0 and ready == n - len(p.replies)
            b = spawn("b", NLLB_MAX_ROWS=8)
            await asyncio.to_thread(b.wait_ready)
            await p.wait_for(cids, 180)
            print(f"\nSIGTERM: worker a answered {ok_a}, requeued {requeued}; b answered the rest; "
                  f"missing 0")
            assert await settle_counts(names) == (0, 0)
            assert b.terminate() == 0
    run(body(), 230)


@pytest.mark.timeout(120)
def test_health_endpoints_and_sigint(names, spawn, broker):
    w = spawn("w")
    w.wait_ready()
    assert w.http("/healthz")[0] == 200
    assert w.http("/readyz")[0] == 200
    status, text = w.http("/metrics")
    assert status == 200 and "nllb_jobs_in_flight" in text and "nllb_event_loop_lag_seconds" in text
    assert "guest:guest" not in w.log_path.read_text()  # the secret never reaches the log
    w.proc.send_signal(2)
    assert w.proc.wait(60) == 0
    _ = subprocess
