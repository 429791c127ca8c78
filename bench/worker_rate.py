"""How many jobs a second one worker process answers through a real broker, and what each costs in CPU.

    python -m bench.worker_rate [--jobs 4000] [--new-tokens 2] [--cpu-threads N] [--url amqp://...]
                                [--model DIR --device cuda] [--engine-only]

The jobs are published to a fresh queue before the worker starts, so the producer's own work does not
compete with the worker for the CPU; the clock and the worker's CPU counters start at the first reply
(after the engine loaded and the consumer started) and stop at the last. Prints jobs/s, the worker
process's CPU per job, and the part of it spent on the event-loop thread (the process's main thread),
which is what limits one worker when the engine is fast (a GPU); and the replies beyond one a job
(`duplicates`: a delivery the broker gave again, as after a channel the broker closed), which must be 0.

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

from worker.amqp import declare_topology
from worker.settings import Settings

TEXTS = ["ta deshacho lidor tu nizela", "kadera", "lidor tu", "nizela ta deshacho", "tu kadera lidor"]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (all its threads) or of one of its threads, in seconds."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # fields 14 and 15 of stat(5)


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
                  device: str = "cpu") -> dict[str, float]:
    queue = f"bench.rate.{uuid.uuid4().hex[:8]}"
    settings = Settings(amqp_url=url, jobs_queue=queue, dead_letter_queue=queue + ".dead")
    conn, replies = await publish_jobs(url, settings, n, new_tokens)
    env = {**os.environ, "NLLB_AMQP_URL": url, "NLLB_JOBS_QUEUE": queue, "NLLB_DEAD_LETTER_QUEUE": queue + ".dead",
           "NLLB_DEVICE": device, "NLLB_METRICS_PORT": "0", "NLLB_LOG_LEVEL": "warning", "NLLB_LOG_FORMAT": "json"}
    env.pop("NLLB_MODEL", None)
    if model:
        env["NLLB_MODEL"] = model
    if cpu_threads is not None:
        env["NLLB_CPU_THREADS"] = str(cpu_threads)
    worker = subprocess.Popen([sys.executable, "-m", "worker", "run"], env=env, stdout=subprocess.DEVNULL)
    errors, got = 0, 0
    answered: set[str | None] = set()
    t0 = cpu0 = loop0 = 0.0
    try:
        async with replies.iterator() as it:
            async for message in it:
                await message.ack()
                got += 1
                errors += json.loads(message.body).get("status") != "ok"
                answered.add(message.correlation_id)
                if got == 1:
                    t0, cpu0, loop0 = time.perf_counter(), cpu_seconds(worker.pid), cpu_seconds(worker.pid, worker.pid)
                if got == n:
                    break
        elapsed = time.perf_counter() - t0
        cpu, loop_cpu = cpu_seconds(worker.pid) - cpu0, cpu_seconds(worker.pid, worker.pid) - loop0
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
            "cpu_ms_per_job": round(cpu / jobs * 1e3, 3), "loop_cpu_ms_per_job": round(loop_cpu / jobs * 1e3, 3)}


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
    args = ap.parse_args()
    if args.engine_only:
        print(json.dumps(engine_rate(args.jobs, args.new_tokens, args.model, args.device, args.cpu_threads)))
        return
    print(json.dumps(asyncio.run(measure(args.url, args.jobs, args.new_tokens, args.cpu_threads, args.model,
                                         args.device))))


if __name__ == "__main__":
    main()
