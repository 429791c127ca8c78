"""How many jobs a second one worker process answers through a real broker, and what each costs in CPU.

    python -m bench.worker_rate [--jobs 4000] [--new-tokens 2] [--mix fixed|stream] [--cpu-threads N]
                                [--url amqp://...] [--model DIR --device cuda] [--engine-only]
                                [--broker-processes N] [--broker-only]

The jobs are published to a fresh queue before the worker starts, so the producer's own work does not compete with
the worker for the CPU. The mix goes in twice, one pass after the other, and the clock and the worker's CPU
counters start at the first reply of the second pass (the n + 1st) and stop at the last: the first pass warms the
worker as it would be warm in service (CUDA graphs captured for the batch sizes, sources and lengths the mix
brings, the allocator grown), and `--engine-only` is timed the same way. `--no-warm`: one pass, the clock from the
first reply (which still follows the engine's load and the consumer's start). Prints jobs/s, the worker process's
CPU per job, and the part of it spent on the event-loop thread (the process's main thread), which is what limits
one worker when the engine is fast (a GPU; with --broker-processes N, the N broker processes' main threads
together, and the CPU of every process of the worker); and the replies beyond one a job (`duplicates`: a delivery
the broker gave again, as after a channel the broker closed), which must be 0; and per process (the worker's, its
broker processes, RabbitMQ's when it runs here, this bench's) the CPU ms a job it took, all its threads and its
busiest one: a process whose busiest thread nears the wall's ms a job holds the rate.

`--broker-only` measures what bounds any worker on the same broker: bench/broker_echo.py answers the same jobs
as the worker does on the broker (a reply of a worker's size, confirmed, then the ack), on --broker-processes
connections, without parsing or translating them.

The toy engine stands in for the GPU's on the CPU, on one thread (the worker's default for a model this small):
with torch's default threads (one per core, `--cpu-threads 2` on a 2-core machine) its tiny operations are split
across both cores and its idle thread spins, so it takes about three times the CPU it takes on one, CPU the
loop thread and the broker then lack.

On the GPU (`--model DIR --device cuda`, with a broker there: bench/broker_bundle.sh) the same jobs measure
whether one worker process feeds the engine: `--engine-only` gives the engine's own rate for them, submitted
in-process (`Engine.submit`, one job a text, both passes at once; the clock as the worker's).

Two job mixes, each job one sentence: `fixed` (the default), a five-word English sentence to French that decodes
exactly --new-tokens tokens, the least work the engine can have a job (what the worker's own cost shows best);
`stream`, the single-sentence jobs of bench.run's arrival stream (bench/workloads.py `make_stream`): sources of
5-120 tokens from four languages to three, greedy or beam 4 (2:1), exactly the new tokens of the source's length
bucket (16, 32, 64 or 128), i.e. what a queue of real sentences asks of the GPU. Either mix is the same jobs for
the worker and for `--engine-only`; the figures add the tokens a second the jobs' outputs make.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aio_pika
import aiormq
import orjson

from worker.topology import declare_topology
from worker.settings import Settings

TEXTS = ["ta deshacho lidor tu nizela", "kadera", "lidor tu", "nizela ta deshacho", "tu kadera lidor"]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
MIXES = ("fixed", "stream")


@dataclass(frozen=True)
class RateJob:
    """One job of the mix: a sentence, its languages and what it decodes (exactly `new_tokens`)."""

    text: str
    src_lang: str
    tgt_lang: str
    num_beams: int
    new_tokens: int

    @property
    def options(self) -> dict[str, int]:
        """The job's `options` as the wire has them (PROTOCOL.md)."""
        return {"num_beams": self.num_beams, "min_new_tokens": self.new_tokens, "max_new_tokens": self.new_tokens}


def rate_jobs(mix: str, n: int, new_tokens: int, model: str | None) -> list[RateJob]:
    """The mix's n jobs (deterministic). `stream`'s sentences are the arrival stream's token ids decoded with the
    model's tokenizer (random pieces: they encode back to within a few tokens of their length)."""
    if mix == "fixed":
        return [RateJob(TEXTS[i % len(TEXTS)], "eng_Latn", "fra_Latn", 1, new_tokens) for i in range(n)]
    from bench.workloads import Vocab, make_stream
    from engine.engine import TOY_MODEL_DIR
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.load(model or TOY_MODEL_DIR)
    return [RateJob(tok.decode(job.segments[0][1:-1]), tok.lang_code(job.segments[0][0]), job.tgt, job.beams,
                    job.new_tokens)
            for job in make_stream(Vocab(tok), n, rate=1.0, quick=False, single=True)]


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
        threads = {}
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that ended since the listing
                threads[int(task.name)] = cpu_seconds(pid, int(task.name))
        return cpu_seconds(pid), threads
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


async def publish_jobs(url: str, settings: Settings, jobs: list[RateJob]
                       ) -> tuple[aio_pika.abc.AbstractConnection, aio_pika.abc.AbstractQueue]:
    """Declare the worker's topology, an exclusive reply queue, and publish the jobs (confirmed)."""
    conn = await aio_pika.connect(url)
    channel = await conn.channel(publisher_confirms=True)
    await declare_topology(channel, settings)
    replies = await channel.declare_queue(exclusive=True)
    for start in range(0, len(jobs), 500):
        await asyncio.gather(*(channel.default_exchange.publish(
            aio_pika.Message(json.dumps({"v": 1, "id": f"rate-{i}", "src_lang": job.src_lang, "tgt_lang": job.tgt_lang,
                                         "text": job.text, "options": job.options}).encode(),
                             content_type="application/json", reply_to=replies.name, correlation_id=str(i)),
            routing_key=settings.jobs_queue) for i, job in enumerate(jobs[start:start + 500], start)))
    return conn, replies


async def measure(url: str, n: int, new_tokens: int, cpu_threads: int | None = None, model: str | None = None,
                  device: str = "cpu", broker_processes: int = 1, broker_only: bool = False,
                  mix: str = "fixed", warm: bool = True) -> dict[str, object]:
    """broker_only: bench/broker_echo.py answers the jobs in place of the worker, on broker_processes
    connections. warm: the n jobs twice, timed from the second pass's first reply."""
    queue = f"bench.rate.{uuid.uuid4().hex[:8]}"
    settings = Settings(amqp_url=url, jobs_queue=queue, dead_letter_queue=queue + ".dead")
    jobs = rate_jobs(mix, n, new_tokens, model)
    untimed = n if warm else 0  # replies before the clock starts
    conn, replies = await publish_jobs(url, settings, jobs * 2 if warm else jobs)
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
        if got == untimed + 1:
            t0 = time.perf_counter()
            cpu0, loop0 = worker_cpu(worker.pid)
            each0 = process_cpu(worker.pid)
        if got == untimed + n:
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
    counted = n - 1  # the clock starts at the first timed reply
    return {"jobs": n, "mix": mix, "errors": errors, "duplicates": got - len(answered), "seconds": round(elapsed, 3),
            **rates(jobs, counted, elapsed),
            "cpu_ms_per_job": round(cpu / counted * 1e3, 3),
            "loop_cpu_ms_per_job": round(loop_cpu / counted * 1e3, 3),
            "per_process_ms_per_job": {name: [round(total / counted * 1e3, 3), round(busiest / counted * 1e3, 3)]
                                       for name, (total, busiest) in each.items()}}


def rates(jobs: list[RateJob], counted: int, elapsed: float) -> dict[str, float]:
    """Jobs and output tokens a second, `counted` jobs in `elapsed` seconds (the mix's mean tokens a job)."""
    per_s = counted / elapsed
    return {"jobs_per_s": round(per_s, 1),
            "tokens_per_s": round(per_s * sum(j.new_tokens for j in jobs) / len(jobs))}


def engine_rate(n: int, new_tokens: int, model: str | None, device: str, cpu_threads: int | None = None,
                mix: str = "fixed", warm: bool = True, host_profile: Path | None = None) -> dict[str, object]:
    """The engine's own rate for the same jobs, submitted in-process all at once (no broker, no worker), on the
    CPU threads the worker would take (worker/cli.py `cpu_threads`); timed as `measure` times the worker (warm:
    both passes submitted, the clock from the second's first answer). host_profile: the engine thread's cProfile
    over the timed part (from the answer that starts the clock), written there (the rate then includes
    cProfile's own cost)."""
    import torch

    from engine import Engine, GenerationOptions
    from worker.cli import cpu_threads as worker_threads

    threads = worker_threads(Settings(model=model, device=device, cpu_threads=cpu_threads))
    if threads is not None:
        torch.set_num_threads(threads)

    jobs = rate_jobs(mix, n, new_tokens, model)
    eng = Engine.load(model, device=device)
    try:
        def submit(job: RateJob):
            return eng.submit([job.text], job.src_lang, job.tgt_lang, GenerationOptions(**job.options))

        finished: list[float] = []  # appended from the engine thread as each job resolves
        prof = cProfile.Profile()
        futures = [submit(job) for job in (jobs * 2 if warm else jobs)]

        def on_done(_) -> None:
            finished.append(time.perf_counter())
            if host_profile is not None and len(finished) == len(futures) - n + 1:
                prof.enable()  # a done callback runs on the engine thread, which cProfile then follows

        for f in futures:
            f.add_done_callback(on_done)
        for f in futures:
            f.result()
        finished.sort()
        elapsed = finished[-1] - finished[len(finished) - n]
        if host_profile is not None:
            eng.post(prof.disable)
    finally:
        eng.close()
    if host_profile is not None:
        from bench.profile_steps import profile_text

        host_profile.write_text(profile_text(prof, 40, 60))
    return {"jobs": n, "mix": mix, "seconds": round(elapsed, 3), **rates(jobs, n - 1, elapsed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=4000, help="jobs to answer (default 4000)")
    ap.add_argument("--new-tokens", type=int, default=2, help="max_new_tokens of each job (default 2)")
    ap.add_argument("--mix", choices=MIXES, default="fixed",
                    help="the jobs: 'fixed' five-word sentences of exactly --new-tokens tokens (default), 'stream' "
                         "the arrival stream's single sentences (their own lengths and beams; --new-tokens unused)")
    ap.add_argument("--no-warm", action="store_true",
                    help="one pass of the jobs, timed from the first reply (default: two, the second timed)")
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="the worker's NLLB_CPU_THREADS, torch's CPU threads (default: the worker's choice, 1 for "
                         "a small model on the CPU, else torch's); with --engine-only, this process's")
    ap.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/", help="broker URL (default: local)")
    ap.add_argument("--model", default=None, help="the worker's NLLB_MODEL (default: the toy model)")
    ap.add_argument("--device", default="cpu", help="the worker's NLLB_DEVICE (default: cpu)")
    ap.add_argument("--engine-only", action="store_true", help="the engine's own rate for the same jobs, in-process")
    ap.add_argument("--host-profile", type=Path, default=None,
                    help="with --engine-only: write the engine thread's cProfile of the timed part to this file")
    ap.add_argument("--broker-processes", type=int, default=1,
                    help="the worker's NLLB_BROKER_PROCESSES (default 1: the broker connection in the engine's "
                         "process)")
    ap.add_argument("--broker-only", action="store_true",
                    help="the broker's own ceiling: bench/broker_echo.py answers the jobs as the worker would, on "
                         "--broker-processes connections, without parsing or translating them")
    args = ap.parse_args()
    if args.engine_only:
        print(json.dumps(engine_rate(args.jobs, args.new_tokens, args.model, args.device, args.cpu_threads,
                                     args.mix, not args.no_warm, args.host_profile)))
        return
    print(json.dumps(asyncio.run(measure(args.url, args.jobs, args.new_tokens, args.cpu_threads, args.model,
                                         args.device, args.broker_processes, args.broker_only, args.mix,
                                         not args.no_warm))))


if __name__ == "__main__":
    main()
