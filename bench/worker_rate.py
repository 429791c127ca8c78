"""How many jobs a second one worker process answers through a real broker, and what each costs in CPU.

    python -m bench.worker_rate [--jobs 4000] [--new-tokens 2] [--cpu-threads N] [--url amqp://...]
                                [--model DIR --device cuda] [--engine-only] [--broker-processes N]
                                [--broker-only]

The jobs are published to a fresh queue before the worker starts, so the producer's own work does not
compete with the worker for the CPU; the clock and the worker's CPU counters start at the first reply
(after the engine loaded and the consumer started) and stop at the last. Prints jobs/s, the worker
process's CPU per job, and the part of it spent on the event-loop thread (the process's main thread),
which is what limits one worker when the engine is fast (a GPU; with --broker-processes N, the N broker
processes' main threads together, and the CPU of every process of the worker); and the replies beyond one a job
(`duplicates`: a delivery the broker gave again, as after a channel the broker closed), which must be 0;
and per process (the worker's, its broker processes, RabbitMQ's when it runs here, this bench's) the CPU ms a
job it took, all its threads and its busiest one: a process whose busiest thread nears the wall's ms a job
holds the rate.

`--broker-only` measures what bounds any worker on the same broker: bench/broker_echo.py answers the same jobs
as the worker does on the broker (a reply of a worker's size, confirmed, then the ack), on --broker-processes
connections, without parsing or translating them.

The toy engine stands in for the GPU's on the CPU, on one thread (the worker's default for a model this small):
with torch's default threads (one per core, `--cpu-threads 2` on a 2-core machine) its tiny operations are split
across both cores and its idle thread spins, so it takes about three times the CPU it takes on one, CPU the
loop thread and the broker then lack.

On the GPU (`--model DIR --device cuda`, with a broker there: bench/broker_bundle.sh) the same jobs measure
whether one worker process feeds the engine: `--engine-only` gives the engine's own rate for them, submitted
in-process (`Engine.submit`, one job a text, all at once; the clock from the first answer to the last).
Every job decodes exactly --new-tokens tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aio_pika
import aiormq
import orjson

from worker.topology import declare_topology
from worker.settings import Settings

TEXTS = ["ta deshacho lidor tu nizela", "kadera", "lidor tu", "nizela ta deshacho", "tu kadera lidor"]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (all its threads) or of one of its threads, in seconds."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # fields 14 and 15 of stat(5)


def child_processes(worker: int) -> tuple[list[int], list[int]]:
    """The worker's child processes, and of them its broker processes (spawned: the others are multiprocessing's
    resource tracker)."""
    children = [int(c) for c in Path(f"/proc/{worker}/task/{worker}/children").read_text().split()]
    return children, [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def process_cpu(worker: int) -> dict[str, tuple[float, dict[int, float]]]:
    """Per process (the worker's, each of its broker processes, the broker's Erlang VM when it runs here, and this
    bench's own): its CPU seconds, and each of its threads'."""
    def of(pid: int) -> tuple[float, dict[int, float]]:
        tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        return cpu_seconds(pid), {tid: cpu_seconds(pid, tid) for tid in tids}
    out = {"worker": of(worker), "bench": of(os.getpid())}
    for i, pid in enumerate(child_processes(worker)[1]):
        out[f"broker process {i}"] = of(pid)
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and (proc / "comm").exists() and (proc / "comm").read_text().strip() == "beam.smp":
            out[f"rabbitmq {proc.name}"] = of(int(proc.name))
    return out


def worker_cpu(pid: int) -> tuple[float, float]:
    """The worker's CPU seconds, all its processes (the engine's and its broker processes), and its event loops'
    (the main thread of each process that holds a broker connection: the broker processes when there are
    any, else the worker's own)."""
    children, brokers = child_processes(pid)
    loops = brokers or [pid]
    return (cpu_seconds(pid) + sum(cpu_seconds(c) for c in children),
            sum(cpu_seconds(p, p) for p in loops))


async def publish_jobs(url: str, settings: Settings, n: int, new_tokens: int) -> tuple[aio_pika.abc.AbstractConnection,
                                                                                       aio_pika.abc.AbstractQueue]:
    """Declare the worker's topology, an exclusive reply queue, and publish n jobs (confirmed)."""
    conn = await aio_pika.connect(url)
    channel = await conn.channel(publisher_confirms=True)
    await declare_topology(channel, settings)
    replies = await channel.declare_queue(exclusive=True)
    for start in range(0, n, 500):
        await asyncio.gather(*(channel.default_exchange.publish(
            aio_pika.Message(json.dumps({"v": 1, "id": f"rate-{i}", "src_lang": "eng_Latn", "tgt_lang": "fra_Latn",
                                         "text": TEXTS[i % len(TEXTS)],
                                         "options": {"min_new_tokens": new_tokens,
                                                     "max_new_tokens": new_tokens}}).encode(),
                             content_type="application/json", reply_to=replies.name, correlation_id=str(i)),
            routing_key=settings.jobs_queue) for i in range(start, min(n, start + 500))))
    return conn, replies


async def measure(url: str, n: int, new_tokens: int, cpu_threads: int | None = None, model: str | None = None,
                  device: str = "cpu", broker_processes: int = 1, broker_only: bool = False) -> dict[str, object]:
    """broker_only: bench/broker_echo.py answers the jobs in place of the worker, on broker_processes
    connections."""
    queue = f"bench.rate.{uuid.uuid4().hex[:8]}"
    settings = Settings(amqp_url=url, jobs_queue=queue, dead_letter_queue=queue + ".dead")
    conn, replies = await publish_jobs(url, settings, n, new_tokens)
    env = {**os.environ, "NLLB_AMQP_URL": url, "NLLB_JOBS_QUEUE": queue, "NLLB_DEAD_LETTER_QUEUE": queue + ".dead",
           "NLLB_DEVICE": device, "NLLB_METRICS_PORT": "0", "NLLB_LOG_LEVEL": "warning", "NLLB_LOG_FORMAT": "json",
           "NLLB_BROKER_PROCESSES": str(broker_processes)}
    env.pop("NLLB_MODEL", None)
    if model:
        env["NLLB_MODEL"] = model
    if cpu_threads is not None:
        env["NLLB_CPU_THREADS"] = str(cpu_threads)
    command = ["-m", "worker", "run"]
    if broker_only:
        command = ["-m", "bench.broker_echo", "--processes", str(broker_processes)]
    worker = subprocess.Popen([sys.executable, *command], env=env, stdout=subprocess.DEVNULL)
    errors, got = 0, 0
    answered: set[str | None] = set()
    t0 = cpu0 = loop0 = 0.0
    each0: dict[str, tuple[float, dict[int, float]]] = {}
    all_in = asyncio.Event()

    async def on_reply(message: aiormq.abc.DeliveredMessage) -> None:
        nonlocal errors, got, t0, cpu0, loop0, each0
        got += 1
        errors += orjson.loads(message.body).get("status") != "ok"
        answered.add(message.header.properties.correlation_id)
        if got == 1:
            t0 = time.perf_counter()
            cpu0, loop0 = worker_cpu(worker.pid)
            each0 = process_cpu(worker.pid)
        if got == n:
            all_in.set()

    try:
        # straight from aiormq, unacknowledged: aio-pika's message objects and acks took this process most of a
        # core at ~3,800 replies a second, near the rate it measured
        channel = await replies.channel.get_underlay_channel()
        await channel.basic_consume(replies.name, on_reply, no_ack=True)
        await all_in.wait()
        elapsed = time.perf_counter() - t0
        cpu, loop_cpu = (end - start for end, start in zip(worker_cpu(worker.pid), (cpu0, loop0)))
        each = {name: (end[0] - each0[name][0], max(t - each0[name][1].get(tid, 0.0) for tid, t in end[1].items()))
                for name, end in process_cpu(worker.pid).items() if name in each0}
    finally:
        worker.terminate()
        worker.wait(60)
        channel = await conn.channel()
        for name in (queue, queue + ".dead"):
            await channel.queue_delete(name)
        await conn.close()
    jobs = n - 1  # the clock starts at the first reply
    return {"jobs": n, "errors": errors, "duplicates": got - len(answered), "seconds": round(elapsed, 3),
            "jobs_per_s": round(jobs / elapsed, 1),
            "cpu_ms_per_job": round(cpu / jobs * 1e3, 3), "loop_cpu_ms_per_job": round(loop_cpu / jobs * 1e3, 3),
            "per_process_ms_per_job": {name: [round(total / jobs * 1e3, 3), round(busiest / jobs * 1e3, 3)]
                                       for name, (total, busiest) in each.items()}}


def engine_rate(n: int, new_tokens: int, model: str | None, device: str, cpu_threads: int | None = None
                ) -> dict[str, float]:
    """The engine's own rate for the same jobs, submitted in-process all at once (no broker, no worker), on the
    CPU threads the worker would take (worker/cli.py `cpu_threads`)."""
    import torch

    from engine import Engine, GenerationOptions
    from worker.cli import cpu_threads as worker_threads

    threads = worker_threads(Settings(model=model, device=device, cpu_threads=cpu_threads))
    if threads is not None:
        torch.set_num_threads(threads)

    eng = Engine.load(model, device=device)
    try:
        opts = GenerationOptions(min_new_tokens=new_tokens, max_new_tokens=new_tokens)
        texts = [TEXTS[i % len(TEXTS)] for i in range(n)]
        eng.translate(texts[:256], "eng_Latn", "fra_Latn", opts)  # graphs and allocator warmed up
        finished: list[float] = []  # appended from the engine thread as each job resolves
        futures = [eng.submit([text], "eng_Latn", "fra_Latn", opts) for text in texts]
        for f in futures:
            f.add_done_callback(lambda _: finished.append(time.perf_counter()))
        for f in futures:
            f.result()
        elapsed = max(finished) - min(finished)
    finally:
        eng.close()
    return {"jobs": n, "seconds": round(elapsed, 3), "jobs_per_s": round((n - 1) / elapsed, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=4000, help="jobs to answer (default 4000)")
    ap.add_argument("--new-tokens", type=int, default=2, help="max_new_tokens of each job (default 2)")
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="the worker's NLLB_CPU_THREADS, torch's CPU threads (default: the worker's choice, 1 for "
                         "a small model on the CPU, else torch's); with --engine-only, this process's")
    ap.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/", help="broker URL (default: local)")
    ap.add_argument("--model", default=None, help="the worker's NLLB_MODEL (default: the toy model)")
    ap.add_argument("--device", default="cpu", help="the worker's NLLB_DEVICE (default: cpu)")
    ap.add_argument("--engine-only", action="store_true", help="the engine's own rate for the same jobs, in-process")
    ap.add_argument("--broker-processes", type=int, default=1,
                    help="the worker's NLLB_BROKER_PROCESSES (default 1: the broker connection in the engine's "
                         "process)")
    ap.add_argument("--broker-only", action="store_true",
                    help="the broker's own ceiling: bench/broker_echo.py answers the jobs as the worker would, on "
                         "--broker-processes connections, without parsing or translating them")
    args = ap.parse_args()
    if args.engine_only:
        print(json.dumps(engine_rate(args.jobs, args.new_tokens, args.model, args.device, args.cpu_threads)))
        return
    print(json.dumps(asyncio.run(measure(args.url, args.jobs, args.new_tokens, args.cpu_threads, args.model,
                                         args.device, args.broker_processes, args.broker_only))))


if __name__ == "__main__":
    main()
