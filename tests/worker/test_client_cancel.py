"""Cancels of the longest valid job ids (512 characters, protocol): NllbClient.cancel sends them as UTF-8 JSON, and
the worker takes the longest cancel any producer may send (every character escaped). Real broker, toy engine."""
from __future__ import annotations

import json

import pytest
from conftest import AMQP_URL, run
from helpers import eventually, in_process_worker

from engine import Engine
from tests.worker.test_worker_cancel import SLOW, long_document
from worker.client import NllbClient
from worker.control import Cancellations

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(120)]

ASTRAL_ID = "\U0001F600" * 512  # 4 bytes each in UTF-8, 12 as an escaped surrogate pair
CONTROL_CHAR_ID = "\x00" * 512  # 6 bytes each however it is sent: \u0000


def test_the_worker_takes_the_longest_cancel_any_producer_sends():
    cancellations = Cancellations(memory_s=60)
    for job_id in (ASTRAL_ID, CONTROL_CHAR_ID):
        cancellations.on_control(json.dumps({"v": 1, "cancel": job_id}).encode())  # json's default: all escaped
        assert cancellations.cancelled(job_id)


def test_client_cancels_a_running_job_whose_id_is_512_astral_characters(settings, names, toy_dir):
    engine = Engine.load(toy_dir, device="cpu", max_rows=8)

    async def body():
        async with in_process_worker(settings, engine), \
                NllbClient(AMQP_URL, names["jobs_queue"], control_exchange=settings.control_exchange) as client:
            listener = await client.connection.channel()
            cancels = await listener.declare_queue(exclusive=True)
            await cancels.bind(settings.control_exchange)
            fut = await client.publish(client.job_body(None, "eng_Latn", "fra_Latn", document=long_document(4, 200),
                                                       options=SLOW, job_id=ASTRAL_ID))
            await eventually(lambda: engine.stats().rows_used > 0, 30, "the document decoding")
            await client.cancel(ASTRAL_ID)
            reply = await client.wait(fut, 10)
            assert reply.id == ASTRAL_ID and reply.error.code == "cancelled"
            sent = await cancels.get(timeout=5)
            assert sent.body == json.dumps({"v": 1, "cancel": ASTRAL_ID}, ensure_ascii=False).encode()  # UTF-8
            await eventually(lambda: engine.stats().rows_used == 0, 5, "the rows freed")
    try:
        run(body(), 90)
    finally:
        engine.close()

