"""Fault tests with `python -m worker run` subprocesses against the real broker: kill -9,
closed connections, a broker restart (the one test that touches the broker outside the tests'
vhost), SIGTERM drains, a second signal, a broker that refuses the worker, queues declared with
other arguments. Every job is counted by id: 0 missing."""
from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import aio_pika
import pytest
from conftest import BROKER_URL, VHOST, free_port, queue_counts, rabbitmqctl, run, wait_broker
from helpers import PlainProducer, eventually, job

from worker.topology import declare_topology

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
@pytest.mark.parametrize("fault, broker_processes", [("close_all_connections", 1), ("broker_restart", 1),
                                                     ("close_all_connections", 2)])
def test_worker_reconnects_by_itself(names, spawn, broker, fault, broker_processes):
    n = 60
    w = spawn("w", NLLB_MAX_ROWS=8, NLLB_BROKER_PROCESSES=broker_processes)
    w.wait_ready()

    async def body():
        async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            cids = [await p.publish(slow_job(i), cid=f"job-{i}") for i in range(n)]
            await eventually(lambda: len(p.replies) >= 3, 120, "first replies")
            before = len(p.replies)
            if fault == "close_all_connections":
                await asyncio.to_thread(rabbitmqctl, "close_all_connections", "--vhost", VHOST,
                                        "--limit", "1000", "test")
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
            assert w.count("reconnected to the broker; consuming resumes") >= broker_processes
            assert w.count("broker process exited unexpectedly; starting it again") == 0
            # a process logs its reconnection before its channels reopen and it consumes again: the other may have
            # answered every job meanwhile, so each is given a few seconds to say it is ready
            for index in range(broker_processes):
                await eventually(lambda: asyncio.to_thread(w.ready, index), 15, f"broker process {index} ready")
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
            requeued = a.count("job settled", outcome="handed_back")
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


DRAIN_JOB = {"num_beams": 4, "min_new_tokens": 200, "max_new_tokens": 200}


def drain_job(i: int) -> dict:
    """About a second of the toy engine's work: segments that take turns for the job's rows."""
    return job([f"the cat sat on the mat {i} {k}" for k in range(8)], options=DRAIN_JOB, id=f"job-{i}")


@pytest.mark.timeout(300)
def test_drains_hand_jobs_back_without_counting_a_delivery(names, settings, spawn, broker):
    """Four SIGTERM/restart cycles with a 0.5 s drain: every job is answered, none dead-lettered,
    though some are handed back more often than the delivery limit (3) allows failures."""
    n, cycles = 16, 4

    async def body():
        async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            await declare_topology(await p.conn.channel(), settings)  # the jobs wait for a worker
            cids = [await p.publish(drain_job(i), cid=f"job-{i}", message_id=f"job-{i}") for i in range(n)]
            handed_back: dict[str, int] = {}
            per_cycle = []
            for c in range(cycles):
                w = spawn(f"drain{c}", NLLB_MAX_ROWS=8, NLLB_PREFETCH=n, NLLB_DRAIN_TIMEOUT_S=0.5)
                await asyncio.to_thread(w.wait_ready)
                await asyncio.sleep(0.5)
                assert await asyncio.to_thread(w.terminate, 60) == 0
                backs = [x["job_id"] for x in w.log_lines()
                         if x.get("event") == "job settled" and x.get("outcome") == "handed_back"]
                for job_id in backs:
                    handed_back[job_id] = handed_back.get(job_id, 0) + 1
                per_cycle.append((w.count("job settled", outcome="ok"), len(backs)))
                assert w.count("job settled", outcome="requeue") == 0
            last = spawn("last", NLLB_MAX_ROWS=8)
            await asyncio.to_thread(last.wait_ready)
            await p.wait_for(cids, 180)
            answered = sum(c in p.replies for c in cids)
            dead = await asyncio.to_thread(queue_counts, names["dead_letter_queue"])
            print(f"\nfour drains: (answered, handed back) per cycle {per_cycle}; most hand-backs of one "
                  f"job {max(handed_back.values(), default=0)}; answered {answered}/{n}; "
                  f"dead-lettered {sum(dead)}")
            assert answered == n and all(p.replies[c][0]["status"] == "ok" for c in cids)
            assert dead == (0, 0)
            assert all(backs > 0 for _, backs in per_cycle), "a drain had nothing to hand back"
            assert await settle_counts(names) == (0, 0)
            assert last.terminate() == 0
    run(body(), 290)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("broker_processes", [1, 2])
def test_second_signal_exits_at_once_and_jobs_return_to_the_queue(names, spawn, broker, broker_processes):
    n = 8
    w = spawn("w", NLLB_MAX_ROWS=8, NLLB_DRAIN_TIMEOUT_S=60, NLLB_BROKER_PROCESSES=broker_processes)
    w.wait_ready()

    async def body():
        async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            for i in range(n):
                await p.publish(drain_job(i), cid=f"job-{i}")
            await asyncio.sleep(1.0)
            w.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            w.proc.send_signal(signal.SIGTERM)
            rc = await asyncio.to_thread(w.proc.wait, 20)
            took = time.monotonic() - t0
            print(f"\nsecond SIGTERM: exit {rc} after {took:.2f} s; {len(p.replies)} answered before")
            assert rc == 128 + signal.SIGTERM and took < 5
            # one line from each process that held deliveries (the engine's process too, when it relays)
            lines = [x for x in w.log_lines() if x.get("event", "").startswith("second signal")]
            assert len(lines) == broker_processes + (broker_processes > 1)
            assert all("back to the queue" in x["event"] for x in lines)
            assert sum(x.get("jobs", 0) for x in lines) >= 1
            broker_pids = [x["pid"] for x in w.log_lines() if x.get("event") == "broker process started"]
            assert not any(Path(f"/proc/{pid}").exists() for pid in broker_pids), "a broker process outlived it"
            left = n - len(p.replies)
            assert await settle_counts(names, (left, 0), 20) == (left, 0)
    run(body(), 100)


@pytest.mark.timeout(120)
def test_queue_declared_with_other_arguments_exits_at_once_naming_the_fix(names, settings, spawn, broker):
    async def declare() -> None:
        conn = await aio_pika.connect(broker)
        await declare_topology(await conn.channel(), settings)  # delivery limit 3
        await conn.close()
    run(declare(), 30)
    w = spawn("w", NLLB_DELIVERY_LIMIT=5)
    rc = w.proc.wait(90)
    errors = [x for x in w.log_lines() if x.get("level") == "error"]
    print(f"\nmismatch: exit {rc}; {errors[0]['error'] if errors else None}")
    assert rc == 78
    assert len(errors) == 1
    line = errors[0]["error"]
    assert f"queue '{names['jobs_queue']}'" in line and "x-delivery-limit=3" in line
    assert "x-delivery-limit=5" in line and "NLLB_DELIVERY_LIMIT=3" in line
    assert w.count("broker not reachable; retrying") == 0


@pytest.mark.timeout(120)
def test_a_metrics_port_taken_exits_78_at_once_naming_the_port_and_the_fix(spawn):
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("", port))
        holder.listen()
        w = spawn("m", NLLB_METRICS_PORT=port)
        assert w.proc.wait(90) == 78
    errors = [x for x in w.log_lines() if x.get("level") == "error"]
    assert [(x["event"], x["port"]) for x in errors] == [("the metrics port cannot be bound; exiting", port)]
    assert "NLLB_METRICS_PORT" in errors[0]["fix"]


def connections_in(vhost: str) -> int:
    out = rabbitmqctl("list_connections", "-q", "--no-table-headers", "vhost")
    return sum(line.strip() == vhost for line in out.splitlines())


@pytest.mark.timeout(150)
def test_a_broker_refusing_the_declarations_stops_the_worker_with_78_naming_the_permissions(names, spawn, broker):
    """A broker that accepts the connection but refuses the declarations (no configure permission in this
    vhost): retrying would meet the same refusal, so the worker exits 78 with the fix, holding at most one
    connection meanwhile."""
    vhost = f"{VHOST}-refusing-{uuid.uuid4().hex[:4]}"
    rabbitmqctl("add_vhost", vhost)
    rabbitmqctl("set_permissions", "-p", vhost, "guest", "^$", ".*", ".*")
    try:
        w = spawn("w", NLLB_AMQP_URL=BROKER_URL.rstrip("/") + "/" + vhost)
        counts = []
        while w.proc.poll() is None:
            counts.append(connections_in(vhost))
        assert w.proc.wait() == 78 and max(counts, default=0) <= 1
        errors = [x["error"] for x in w.log_lines() if x.get("event") == "the broker refuses this worker; exiting"]
        assert len(errors) == 1 and "ACCESS_REFUSED" in errors[0] and "set_permissions" in errors[0]
        assert w.count("broker not reachable; retrying") == 0
    finally:
        subprocess.run(["rabbitmqctl", "delete_vhost", vhost], capture_output=True, timeout=120, check=False)


LONG = {"num_beams": 4, "min_new_tokens": 250, "max_new_tokens": 250}


def long_job(i: int, **options: object) -> dict:
    """32 rows for 250 steps: six of them take the toy engine ~4 s together."""
    return job([f"the cat sat on the mat {i} {k}" for k in range(8)], options={**LONG, **options}, id=f"long-{i}")


@pytest.mark.timeout(240)
def test_jobs_whose_channel_closes_mid_decode_are_stopped_there_and_answered_once(names, spawn, broker):
    """The broker requeues what a closed channel held, so the redelivery gives the answer: the worker stops the
    jobs of that channel (their engine rows freed, nothing more published for them) instead of finishing them
    beside their redeliveries, which answered each job twice and interleaved its partials with the final."""
    n = 6
    w = spawn("w", NLLB_MAX_ROWS=256)
    w.wait_ready()

    async def body():
        async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            cids = [await p.publish(long_job(i, progress=i % 2 == 0), cid=f"long-{i}") for i in range(n)]
            await asyncio.sleep(1.0)  # all held, a quarter into their decode
            assert not p.replies
            await asyncio.to_thread(rabbitmqctl, "close_all_connections", "--vhost", VHOST, "--limit", "1000",
                                    "test")
            def finals() -> dict[str, list[dict]]:
                return {c: [r for r in p.replies.get(c, []) if r["status"] != "partial"] for c in cids}
            await eventually(lambda: all(finals().values()), 200, "every final reply")
            assert await settle_counts(names, timeout=60) == (0, 0)  # every delivery settled, redeliveries too
            await asyncio.sleep(0.5)  # replies in transit
            assert all(len(f) == 1 and f[0]["status"] == "ok" for f in finals().values()), finals()
            assert all(p.replies[c][-1]["status"] == "ok" for c in cids)  # no partial after the final
            assert w.count("job stopped: its channel closed and the broker requeued it") == n
            assert w.terminate() == 0
    run(body(), 230)


@pytest.mark.timeout(240)
def test_a_drain_after_a_closed_channel_hands_back_no_job_the_broker_already_requeued(names, spawn, broker):
    """A drain republishes each unfinished job and acks the original; for a delivery of a channel that closed,
    the broker holds the original already, so a copy would be a second job in the queue."""
    n = 6

    async def body():
        async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            w = spawn("w", NLLB_MAX_ROWS=256, NLLB_DRAIN_TIMEOUT_S=0.5)
            await asyncio.to_thread(w.wait_ready)
            for i in range(n):
                await p.publish(long_job(i), cid=f"long-{i}", message_id=f"long-{i}")
            await asyncio.sleep(1.0)  # all held, a quarter into their decode
            await asyncio.to_thread(rabbitmqctl, "close_all_connections", "--vhost", VHOST, "--limit", "1000",
                                    "test")
            await asyncio.sleep(1.0)
            assert await asyncio.to_thread(w.terminate, 60) == 0
            queued = []
            ch = await p.conn.channel()
            jobs = await ch.get_queue(names["jobs_queue"], ensure=False)
            while (m := await jobs.get(fail=False)) is not None:
                queued.append(m.message_id)
                await m.ack()
            answered = [c for c in p.replies if any(r["status"] == "ok" for r in p.replies[c])]
            print(f"\nafter the drain: {len(answered)} answered, queued {sorted(queued)}")
            assert len(queued) == len(set(queued)), "a job is in the queue twice"
            assert set(queued) | set(answered) == {f"long-{i}" for i in range(n)}
    run(body(), 230)
