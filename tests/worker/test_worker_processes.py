"""NLLB_BROKER_PROCESSES > 1 (worker/processes.py): one engine process, broker processes feeding it, as
`python -m worker run` subprocesses against the real broker. Their replies are the engine's (the session's toy
engine is the oracle); every error, progress message and cancel goes through; a killed broker process is
replaced, a killed engine process takes its broker processes down, and a SIGTERM drains them all. Every job is
counted by id: none missing, none dead-lettered."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from pathlib import Path

import aio_pika
import aiormq
import pytest
from conftest import free_port, queue_counts, run
from helpers import PlainProducer, eventually, job
from structlog.testing import capture_logs
from test_worker_cancel import doc_job, long_document, send_control

from engine.options import GenerationOptions
from worker.topology import declare_topology
from worker.processes import UNREADY_EXITS_MAX, BrokerProcess, Supervisor
from worker.serve import EX_CONFIG, STOP_SIGNALS
from worker.settings import Settings

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

TEXTS = ["hello world", "the cat sat on the mat", "a b c d e f", "good morning to you"]
SLOW = {"num_beams": 4, "min_new_tokens": 60, "max_new_tokens": 60}


def broker_pids(w) -> list[int]:
    """The live broker processes' pids, from the supervisor's log (the latest of each index)."""
    started = {x["index"]: x["pid"] for x in w.log_lines() if x.get("event") == "broker process started"}
    return [pid for pid in started.values() if alive(pid)]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def jobs_ok(w, port: int) -> float:
    """nllb_jobs_total{outcome="ok"} of the broker process whose endpoints are on `port`."""
    w.port = port
    _, text = w.http("/metrics")
    line = next(x for x in text.splitlines() if x.startswith('nllb_jobs_total{code="",outcome="ok"}'))
    return float(line.split()[-1])


async def slow_jobs_under_way(p: PlainProducer, n: int, answered: int) -> list[str]:
    """n slow jobs published, once `answered` of them are answered and before all are: a fault then meets jobs in
    flight."""
    cids = [await p.publish(job([f"the cat sat on the mat {i}", f"hello {i}"], options=SLOW), cid=f"job-{i}")
            for i in range(n)]
    await eventually(lambda: len(p.replies) >= answered, 120, "first replies")
    assert len(p.replies) < n, "the jobs finished before the fault; make them slower"
    return cids


async def all_answered_ok(p: PlainProducer, cids: list[str], names, spawn=None) -> None:
    """Every job answered ok (by a fresh one-process worker, when `spawn` is given), and the queue empty."""
    fresh = spawn("fresh", NLLB_MAX_ROWS=16) if spawn is not None else None
    if fresh is not None:
        await asyncio.to_thread(fresh.wait_ready)
    await p.wait_for(cids, 180)
    assert all(p.replies[c][-1]["status"] == "ok" for c in cids)
    assert await queue_empty(names) == (0, 0)
    if fresh is not None:
        assert fresh.terminate() == 0


async def queue_empty(names) -> tuple[int, int]:
    t_end = time.monotonic() + 30
    while True:
        counts = await asyncio.to_thread(queue_counts, names["jobs_queue"])
        if counts == (0, 0) or time.monotonic() > t_end:
            return counts
        await asyncio.sleep(0.5)


@pytest.mark.timeout(240)
def test_broker_processes_answer_as_the_engine_does_errors_progress_and_cancels_included(names, spawn, broker,
                                                                                         engine):
    w = spawn("p", NLLB_BROKER_PROCESSES=2)
    w.wait_ready()
    assert len(broker_pids(w)) == 2
    expected = engine.translate(TEXTS, "eng_Latn", "fra_Latn", options=GenerationOptions(num_beams=2))
    doc = long_document(3, 6)
    doc_expected = engine.submit_document(doc, "eng_Latn", "fra_Latn").result(60)

    async def body():
        async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            same = [await p.publish(job(TEXTS, options={"num_beams": 2, "return_tokens": True}), cid=f"same-{i}")
                    for i in range(40)]
            refused = {await p.publish(job(TEXTS, adapter="nope"), cid="adapter"): "unknown_adapter",
                       await p.publish(job(TEXTS, src="xxx_Latn"), cid="lang"): "unknown_language"}
            progressed = await p.publish(doc_job(doc, options={"progress": True}), cid="doc")
            slow = await p.publish(job(TEXTS, options={"min_new_tokens": 150, "max_new_tokens": 160},
                                       id="cancel-me"), cid="slow")
            await eventually(lambda: len(p.replies) >= 10, 60, "first replies")
            await send_control(broker, "nllb.control", {"v": 1, "cancel": "cancel-me"})
            await p.wait_for(same + list(refused) + [progressed, slow], 120)
            await eventually(lambda: p.replies[progressed][-1]["status"] != "partial", 60, "the document's answer")
            for cid in same:
                r = p.replies[cid][0]
                assert r["status"] == "ok", r
                assert [t["text"] for t in r["translations"]] == [e.text for e in expected]
                assert [t["tokens"] for t in r["translations"]] == [e.tokens for e in expected]
            for cid, code in refused.items():
                assert p.replies[cid][0]["status"] == "error" and p.replies[cid][0]["error"]["code"] == code
            assert p.replies["slow"][-1]["error"]["code"] == "cancelled"
            doc_replies = p.replies["doc"]
            partials = [r for r in doc_replies if r["status"] == "partial"]
            assert partials and doc_replies[-1]["status"] == "ok"
            assert doc_replies[-1]["document"] == doc_expected.text
            assert {r["total"] for r in partials} == {len(doc_expected.segments)}
            assert sum(len(p.replies[c]) for c in same + list(refused)) == len(same) + len(refused)
            assert await queue_empty(names) == (0, 0)
    run(body(), 200)
    shares = [jobs_ok(w, w.port + i) for i in range(2)]
    print(f"\ntwo broker processes answered {shares} of the ok jobs")
    assert all(share > 0 for share in shares)
    assert w.terminate() == 0


@pytest.mark.timeout(240)
def test_a_killed_broker_process_is_replaced_and_its_jobs_are_answered(names, spawn, broker):
    n = 60
    w = spawn("k", NLLB_BROKER_PROCESSES=2, NLLB_MAX_ROWS=16)
    w.wait_ready()
    victim = broker_pids(w)[0]

    async def body():
        async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            cids = await slow_jobs_under_way(p, n, answered=3)
            os.kill(victim, signal.SIGKILL)
            await eventually(lambda: w.count("broker process exited unexpectedly; starting it again") == 1, 30,
                             "the supervisor notices")
            await eventually(lambda: len(broker_pids(w)) == 2 and victim not in broker_pids(w),
                             60, "a new broker process")
            await all_answered_ok(p, cids, names)
    run(body(), 230)
    assert w.proc.poll() is None, "the worker died with its broker process"
    assert w.terminate() == 0


@pytest.mark.timeout(240)
def test_a_killed_engine_process_takes_its_broker_processes_down_and_loses_no_job(names, spawn, broker):
    n = 40
    w = spawn("e", NLLB_BROKER_PROCESSES=2, NLLB_MAX_ROWS=16)
    w.wait_ready()
    children = broker_pids(w)

    async def body():
        async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            cids = await slow_jobs_under_way(p, n, answered=2)
            w.kill9()
            await eventually(lambda: not any(alive(c) for c in children), 30, "its broker processes exit")
            await all_answered_ok(p, cids, names, spawn)
    run(body(), 230)


@pytest.mark.timeout(240)
def test_sigterm_drains_every_broker_process_and_exits_0(names, spawn, broker):
    n = 30
    w = spawn("t", NLLB_BROKER_PROCESSES=3, NLLB_MAX_ROWS=8, NLLB_DRAIN_TIMEOUT_S=0.2)
    w.wait_ready()
    children = broker_pids(w)
    assert len(children) == 3

    async def body():
        async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            cids = await slow_jobs_under_way(p, n, answered=1)
            assert await asyncio.to_thread(w.terminate, 60) == 0
            assert not any(alive(c) for c in children)
            assert w.count("stopped", broker_processes=3) == 1
            assert w.count("job settled", outcome="handed_back") >= 1, "nothing in flight at SIGTERM"
            await all_answered_ok(p, cids, names, spawn)
    run(body(), 230)


@pytest.mark.timeout(120)
def test_a_topology_mismatch_in_a_broker_process_stops_the_worker_with_78(names, settings, spawn, broker):
    async def declare() -> None:
        conn = await aio_pika.connect(broker)
        await declare_topology(await conn.channel(), settings)  # delivery limit 3
        await conn.close()
    run(declare(), 30)
    w = spawn("m", NLLB_BROKER_PROCESSES=2, NLLB_DELIVERY_LIMIT=5)
    assert w.proc.wait(90) == 78
    assert w.count("a broker process cannot run with these settings (its error above says why); stopping") >= 1
    assert w.count("broker process exited unexpectedly; starting it again") == 0


@pytest.mark.timeout(120)
def test_a_broker_process_whose_metrics_port_is_taken_stops_the_worker_with_78_naming_the_port(spawn):
    """Broker process 1 serves its metrics on NLLB_METRICS_PORT + 1: held by another socket here, it logs the
    port and the fix once and the worker stops with 78, where starting it again would only meet the same port."""
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("", port + 1))
        holder.listen()
        w = spawn("p", NLLB_BROKER_PROCESSES=2, NLLB_METRICS_PORT=port)
        assert w.proc.wait(90) == 78
    errors = [x for x in w.log_lines() if x.get("event") == "the metrics port cannot be bound; exiting"]
    assert [x["port"] for x in errors] == [w.port + 1]
    assert "NLLB_METRICS_PORT" in errors[0]["fix"]
    assert w.count("a broker process cannot run with these settings (its error above says why); stopping") == 1
    assert w.count("broker process exited unexpectedly; starting it again") == 0



class EngineStub:
    """What the supervisor asks of its engine, for broker processes that never reach it."""

    closed = False

    def stats(self) -> None:
        return None

    def is_alive(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True


def start_one_that_exits_at_once(self: Supervisor, index: int, restarted: bool = False) -> None:
    """Supervisor._start for a broker process that fails before it is ready (as a crash at its start-up does)."""
    process = self._spawn.Process(target=os._exit, args=(1,))
    process.start()
    self._procs[index] = BrokerProcess(index, process)


@pytest.mark.timeout(30)
def test_broker_processes_that_exit_before_they_are_ready_again_and_again_stop_the_worker_with_78(monkeypatch):
    monkeypatch.setattr(Supervisor, "_start", start_one_that_exits_at_once)
    settings = Settings(_env_file=None, broker_processes=2, metrics_port=0, reconnect_interval_s=0.05)
    engine = EngineStub()
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}  # run() takes them over
    try:
        with capture_logs() as logs:
            status = Supervisor(settings, engine, "w").run()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert status == EX_CONFIG and engine.closed
    stops = [x for x in logs if x["event"].startswith("a broker process exited before it consumed, again and again")]
    assert len(stops) == 1 and stops[0]["exits"] == UNREADY_EXITS_MAX
    restarts = [x["index"] for x in logs if x["event"] == "broker process exited unexpectedly; starting it again"]
    assert restarts.count(stops[0]["index"]) == UNREADY_EXITS_MAX - 1


@pytest.mark.timeout(240)
def test_a_broker_process_restarted_while_the_jobs_queue_is_declared_otherwise_waits_and_the_worker_goes_on(
        names, spawn, broker):
    """A broker process killed while the jobs queue is declared otherwise (the running processes wait, not ready)
    is started again into the same wait: the worker does not stop with 78 as it does when that is so at its
    start."""
    w = spawn("q", NLLB_BROKER_PROCESSES=2, NLLB_MAX_ROWS=8)
    w.wait_ready()
    victim = broker_pids(w)[0]

    async def swap() -> None:
        conn = await aio_pika.connect(broker)
        ch = await conn.channel()
        await ch.queue_delete(names["jobs_queue"])
        for _ in range(20):  # again while the workers put their quorum queue back first
            with contextlib.suppress(aiormq.exceptions.ChannelPreconditionFailed):
                await ch.declare_queue(names["jobs_queue"], durable=True)
                break
            ch = await conn.channel()
            await ch.queue_delete(names["jobs_queue"])
        await conn.close()
    run(swap(), 30)
    mismatch = "the broker's queues were declared anew otherwise: not consuming jobs until they match this " \
               "worker's settings again"
    t_end = time.monotonic() + 30
    while w.count(mismatch) < 2 and time.monotonic() < t_end:
        time.sleep(0.2)
    assert w.count(mismatch) == 2, "both broker processes see the mismatch"
    os.kill(victim, signal.SIGKILL)
    while w.count(mismatch) < 3 and time.monotonic() < t_end + 30:
        time.sleep(0.2)
    assert w.count(mismatch) == 3, "the new broker process waits for the queue too"
    time.sleep(2)
    assert w.proc.poll() is None and w.count("broker process exited unexpectedly; starting it again") == 1
    assert w.terminate(60) == 0
