"""The broker's own ceiling for the worker's message flow: what the worker does on the broker for each job, and
nothing else. `bench.worker_rate --broker-only N` runs it in place of the worker, so the two rates compare.

    python -m bench.broker_echo --queue Q [--url amqp://...] [--processes N] [--prefetch P]

Each of N processes (the first this one, the others spawned, as the worker's broker processes are) holds one
connection and one channel with publisher confirms, consumes Q with the prefetch the worker would take, and
answers every delivery as the worker does: a reply of a worker's size (the JSON of a one-text job's answer) to its
`reply_to` with its `correlation_id`, then, once that reply is confirmed, the delivery's ack. The acks go as the
worker's do (worker/acks.py): at the end of a loop iteration, one `basic.ack multiple=True` for the run of
consecutive confirmed tags from the first unsettled one. No body is parsed and nothing is translated, so the rate
it reaches is the broker's and the client library's for these frames; a worker reaching it is held by the broker.
Runs until terminated.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import signal
import sys

import aiormq
import orjson
from pamqp.commands import Basic

from worker.settings import MAX_ROWS

# the answer of a one-text job as the worker writes it (worker/messages.py OkReply), with a short translation
REPLY = orjson.dumps({
    "v": 1, "id": "rate-0", "status": "ok",
    "translations": [{"text": "le chat est sur la table", "warnings": [], "detected_lang": None,
                      "detected_confidence": None, "retried": False}],
    "src_lang": "eng_Latn", "tgt_lang": "fra_Latn", "adapter": None, "model": "nllb-200-600M",
    "usage": {"src_tokens": 8, "tgt_tokens": 16},
    "timings_ms": {"queue": 1.0, "compute": 20.0, "total": 21.0}})


class Acks:
    """Confirmed deliveries acknowledged once a loop iteration, as one multiple ack for the consecutive run."""

    def __init__(self, channel: aiormq.abc.AbstractChannel):
        self.channel = channel
        self.confirmed: set[int] = set()
        self.next_tag = 1  # the channel's first unsettled delivery tag
        self.flush_queued = False

    def confirm(self, tag: int) -> None:
        self.confirmed.add(tag)
        if not self.flush_queued:
            self.flush_queued = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_queued = False
        last = self.next_tag - 1
        while last + 1 in self.confirmed:
            last += 1
            self.confirmed.discard(last)
        if last >= self.next_tag:
            self.next_tag = last + 1
            asyncio.get_running_loop().create_task(self.channel.basic_ack(last, multiple=True))


async def echo(url: str, queue: str, prefetch: int) -> None:
    connection = await aiormq.connect(url)
    channel = await connection.channel(publisher_confirms=True)
    await channel.basic_qos(prefetch_count=prefetch)
    acks = Acks(channel)

    async def answer(message: aiormq.abc.DeliveredMessage) -> None:
        props = message.header.properties
        await channel.basic_publish(REPLY, routing_key=props.reply_to or "", properties=Basic.Properties(
            correlation_id=props.correlation_id, content_type="application/json", delivery_mode=2))
        acks.confirm(message.delivery.delivery_tag)

    await channel.basic_consume(queue, answer)
    await asyncio.Event().wait()


def serve(url: str, queue: str, prefetch: int) -> None:
    asyncio.run(echo(url, queue, prefetch))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queue", required=True, help="the jobs queue (declared already)")
    ap.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/", help="broker URL (default: local)")
    ap.add_argument("--processes", type=int, default=1, help="connections, one process each (default 1)")
    ap.add_argument("--prefetch", type=int, default=None,
                    help="prefetch a connection (default: the worker's on a GPU, whose engine takes 4,096 rows: "
                         "twice those shared among the processes)")
    args = ap.parse_args()
    prefetch = args.prefetch or -(-2 * MAX_ROWS // args.processes)  # worker/service.py's default
    spawn = multiprocessing.get_context("spawn")
    others = [spawn.Process(target=serve, args=(args.url, args.queue, prefetch), daemon=True)
              for _ in range(args.processes - 1)]
    for p in others:
        p.start()

    def stop(*_: object) -> None:  # the bench terminates this process: the spawned ones go with it
        for p in others:
            p.terminate()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    serve(args.url, args.queue, prefetch)


if __name__ == "__main__":
    main()
