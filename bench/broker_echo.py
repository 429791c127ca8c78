"""The ceiling the broker sets for the worker's message flow: the worker's own broker path with nothing to do for
a job. `bench.worker_rate --broker-only N` runs it in place of the worker, so the two rates compare.

    python -m bench.broker_echo [--processes N] [--prefetch P]     # the worker's NLLB_* settings from the env

Each of N processes (the first this one, the others spawned, as the worker's broker processes are) connects with
the worker's `Broker` (worker/amqp.py: its frame reader and decoder, the topology, the same consumer) and
answers every delivery as the worker does on the broker: a reply of a worker's size (the JSON of a one-text
job's answer) published with `Broker.publish` (batched reply frames, confirmed) to its `reply_to` with its
`correlation_id`, then the ack through `settle` (acks batched after the confirms, worker/acks.py). No body is
parsed and nothing is translated, so a worker that reaches this rate is held by the broker, not by itself.
Runs until terminated.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import signal

import orjson

from worker.amqp import Broker, Delivery, settle
from worker.metrics import Metrics
from worker.serve import run_loop
from worker.settings import MAX_ROWS, Settings

# the answer of a one-text job as the worker writes it (worker/messages.py OkReply), with a short translation
REPLY = orjson.dumps({
    "v": 1, "id": "rate-0", "status": "ok",
    "translations": [{"text": "le chat est sur la table", "warnings": [], "detected_lang": None,
                      "detected_confidence": None, "retried": False}],
    "src_lang": "eng_Latn", "tgt_lang": "fra_Latn", "adapter": None, "model": "nllb-200-600M",
    "usage": {"src_tokens": 8, "tgt_tokens": 16},
    "timings_ms": {"queue": 1.0, "compute": 20.0, "total": 21.0}})


async def echo(prefetch: int) -> int:
    broker = Broker(Settings(), Metrics(), name="broker-echo")
    await broker.connect(prefetch)
    tasks: set[asyncio.Task[None]] = set()

    async def answer(message: Delivery) -> None:
        props = message.properties
        await broker.publish(REPLY, props.reply_to or "", correlation_id=props.correlation_id)
        await settle(message, "ack", broker)

    def on_delivery(message: Delivery) -> None:
        task = asyncio.ensure_future(answer(message))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    await broker.consume(on_delivery, on_lost=lambda _channel: None)
    await asyncio.Event().wait()
    return 0


def serve(prefetch: int) -> None:
    run_loop(echo(prefetch))  # uvloop, as the worker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=1, help="connections, one process each (default 1)")
    ap.add_argument("--prefetch", type=int, default=None,
                    help="prefetch a connection (default: the worker's on a GPU, whose engine takes 4,096 rows: "
                         "twice those shared among the processes)")
    args = ap.parse_args()
    prefetch = args.prefetch or -(-2 * MAX_ROWS // args.processes)  # worker/service.py's default
    spawn = multiprocessing.get_context("spawn")
    others = [spawn.Process(target=serve, args=(prefetch,), daemon=True)
              for _ in range(args.processes - 1)]
    for p in others:
        p.start()

    def stop(*_: object) -> None:  # the bench terminates this process: the spawned ones go with it
        for p in others:
            p.terminate()
        os._exit(0)  # at once: nothing of the echo needs closing, and no task sees the exit

    signal.signal(signal.SIGTERM, stop)
    serve(prefetch)


if __name__ == "__main__":
    main()
