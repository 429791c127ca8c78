"""Several workers on one queue, a soak, and event-loop responsiveness under load."""
from __future__ import annotations

import asyncio
import statistics
import time

import pytest
from conftest import run, settled_counts
from helpers import PlainProducer, in_process_worker, job

from worker.client import NllbClient

pytestmark = [pytest.mark.rabbitmq]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_three_workers_share_the_load(names, spawn, broker):
    n = 300
    workers = [spawn(t, NLLB_MAX_ROWS=4) for t in "abc"]
    for w in workers:
        w.wait_ready()

    async def body():
        async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            cids = [await p.publish(job([f"hello world number {i}", "the cat sat on the mat"],
                                        options={"num_beams": 2, "min_new_tokens": 10, "max_new_tokens": 10}),
                                    cid=f"job-{i}") for i in range(n)]
            await p.wait_for(cids, 200)
            dups = sum(len(v) - 1 for v in p.replies.values())
            assert all(p.replies[c][0]["status"] == "ok" for c in cids)
        return dups

    dups = run(body(), 220)
    per_worker = []
    for w in workers:
        assert w.terminate() == 0
        per_worker.append(w.count("job settled", outcome="ok"))
    print(f"\nthree workers: per worker {per_worker}, total {sum(per_worker)}, duplicates {dups}")
    assert sum(per_worker) == n + dups
    assert all(k > 0 for k in per_worker), per_worker
    assert settled_counts(names["jobs_queue"]) == (0, 0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_soak_2000_jobs_two_workers(names, spawn, broker):
    n = 2000
    workers = [spawn(t, NLLB_MAX_ROWS=32) for t in "ab"]
    for w in workers:
        w.wait_ready()

    async def body():
        async with NllbClient(broker, names["jobs_queue"], reply_queue=names["reply_queue"],
                              name="test-soak") as client:
            sem = asyncio.Semaphore(256)
            lat: list[float] = []

            async def one(i: int):
                async with sem:
                    t0 = time.perf_counter()
                    words = ["hello", "world", "the", "cat", "sat", "on", "mat"]
                    text = " ".join(words[(i + k) % 7] for k in range(3 + i % 5))
                    r = await client.translate(text, "eng_Latn", "fra_Latn" if i % 2 else "deu_Latn",
                                               job_id=f"soak-{i}", timeout=240)
                    lat.append(time.perf_counter() - t0)
                    return r

            t0 = time.perf_counter()
            replies = await asyncio.gather(*(one(i) for i in range(n)))
            wall = time.perf_counter() - t0
            assert len(replies) == n and all(r.status == "ok" for r in replies)
            assert len({r.id for r in replies}) == n
            lat.sort()
            p50, p99 = statistics.median(lat), lat[int(0.99 * (len(lat) - 1))]
            print(f"\nsoak: {n} jobs, 2 workers, {wall:.1f} s, {n / wall:.1f} jobs/s, "
                  f"latency p50 {p50 * 1e3:.0f} ms p99 {p99 * 1e3:.0f} ms, "
                  f"duplicates {client.duplicates}, late {client.late}, lost 0")
            return client.duplicates

    dups = run(body(), 280)
    served = []
    for w in workers:
        assert w.terminate() == 0
        served.append(w.count("job settled", outcome="ok"))
    assert sum(served) == n + dups
    assert settled_counts(names["jobs_queue"]) == (0, 0)


@pytest.mark.timeout(180)
def test_event_loop_stays_responsive_while_engine_busy(settings, names, engine, broker):
    """The engine computes on its own thread; the loop must keep ticking (AMQP heartbeats)."""
    async def body():
        async with in_process_worker(settings, engine), \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            lags: list[float] = []
            stop = asyncio.Event()

            async def ticker():
                while not stop.is_set():
                    t0 = time.perf_counter()
                    await asyncio.sleep(0.01)
                    lags.append(time.perf_counter() - t0 - 0.01)

            tick = asyncio.create_task(ticker())
            busy0 = time.perf_counter()
            cids = [await p.publish(job(["the cat sat on the mat"] * 4,
                                        options={"num_beams": 4, "min_new_tokens": 30, "max_new_tokens": 30}))
                    for _ in range(40)]
            await p.wait_for(cids, 150)
            busy = time.perf_counter() - busy0
            stop.set()
            await tick
            lags.sort()
            p99, worst = lags[int(0.99 * (len(lags) - 1))], lags[-1]
            print(f"\nloop lag while the engine was busy for {busy:.1f} s: {len(lags)} ticks, "
                  f"p50 {statistics.median(lags) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, "
                  f"max {worst * 1e3:.1f} ms")
            assert busy > 1.0, "the load was too light to show anything"
            assert p99 < 0.05 and worst < 0.25
    run(body(), 170)
