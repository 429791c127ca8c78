"""deploy/rabbitmq: the definitions load into a running broker with load-definitions.sh, and the
worker's own declarations (jobs queue with its exact arguments, DLQ, DLX) are then accepted as
equivalent: no PRECONDITION_FAILED. Uses the production names on the test broker and leaves them
declared (declaring is idempotent; other tests may rely on them)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from deploy_support import (
    DEAD_LETTER_EXCHANGE_TYPE,
    DEAD_LETTER_QUEUE_ARGUMENTS,
    DEPLOY,
    JOBS_QUEUE_ARGUMENTS,
)

aio_pika = pytest.importorskip("aio_pika")
from aiormq.exceptions import ChannelPreconditionFailed  # noqa: E402  (after the importorskip)

pytestmark = pytest.mark.rabbitmq

SCRIPT = DEPLOY / "rabbitmq" / "load-definitions.sh"


@functools.cache
def _rabbitmqctl_works() -> bool:
    if shutil.which("rabbitmqctl") is None:
        return False
    probe = subprocess.run(["rabbitmqctl", "-q", "status"], check=False, capture_output=True, timeout=60)
    return probe.returncode == 0


async def _declare(url: str, name: str, arguments: dict) -> None:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        await channel.declare_queue(name, durable=True, arguments=arguments)
    finally:
        await connection.close()


async def _wait_for_queues(url: str, names: list[str], timeout: float = 30.0) -> None:
    # import_definitions is asynchronous: poll with passive declares until the queues exist.
    deadline = time.monotonic() + timeout
    connection = await aio_pika.connect(url)
    try:
        for name in names:
            while True:
                channel = await connection.channel()
                try:
                    await channel.declare_queue(name, passive=True)
                    break
                except aio_pika.exceptions.ChannelClosed:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"queue {name} did not appear after loading definitions")
                    await asyncio.sleep(0.25)
    finally:
        await connection.close()


@pytest.fixture(scope="module")
def loaded() -> None:
    """Run deploy/rabbitmq/load-definitions.sh against the broker (rabbitmqctl, no plugin needed)."""
    if _rabbitmqctl_works():
        with_tool = "rabbitmqctl"
    elif shutil.which("rabbitmqadmin") is not None:
        with_tool = "rabbitmqadmin"
    else:
        pytest.skip("neither a working rabbitmqctl nor rabbitmqadmin to load definitions with")
    result = subprocess.run(
        ["bash", str(SCRIPT)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LOAD_WITH": with_tool},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_worker_declarations_match_the_loaded_definitions(amqp_url: str, loaded: None) -> None:
    async def main() -> None:
        await _wait_for_queues(amqp_url, ["nllb.jobs", "nllb.jobs.dead"])
        # Exactly what the worker declares: must be equivalent, never PRECONDITION_FAILED.
        await _declare(amqp_url, "nllb.jobs", JOBS_QUEUE_ARGUMENTS)
        await _declare(amqp_url, "nllb.jobs.dead", DEAD_LETTER_QUEUE_ARGUMENTS)
        connection = await aio_pika.connect(amqp_url)
        try:
            channel = await connection.channel()
            await channel.declare_exchange("nllb.dlx", DEAD_LETTER_EXCHANGE_TYPE, durable=True)
        finally:
            await connection.close()

        # The check bites: a different delivery limit, or a max length as an x-argument (it lives
        # in a policy), is refused on the loaded queue.
        for key, value in (("x-delivery-limit", 5), ("x-max-length", 10)):
            with pytest.raises(ChannelPreconditionFailed):
                await _declare(amqp_url, "nllb.jobs", {**JOBS_QUEUE_ARGUMENTS, key: value})

    asyncio.run(asyncio.wait_for(main(), 90))


def test_policies_and_binding_are_in_force(amqp_url: str, loaded: None) -> None:
    if not _rabbitmqctl_works():
        pytest.skip("rabbitmqctl cannot reach the broker")

    def ctl(*args: str) -> list[dict]:
        out = subprocess.run(
            ["rabbitmqctl", "-q", *args, "--formatter", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        return json.loads(out)

    deadline = time.monotonic() + 30
    while True:
        queues = {q["name"]: q for q in ctl("list_queues", "name", "type", "durable", "policy")}
        if all(queues.get(n, {}).get("policy") for n in ("nllb.jobs", "nllb.jobs.dead")):
            break
        assert time.monotonic() < deadline, f"policies not applied: {queues}"
        time.sleep(0.5)
    assert queues["nllb.jobs"]["type"] == "quorum" and queues["nllb.jobs"]["durable"]
    assert queues["nllb.jobs"]["policy"] == "nllb-jobs-limits"
    assert queues["nllb.jobs.dead"]["policy"] == "nllb-dead-letter-limits"
    policies = {p["name"]: p for p in ctl("list_policies")}
    definition = policies["nllb-jobs-limits"]["definition"]
    if isinstance(definition, str):
        definition = json.loads(definition)
    assert definition["overflow"] == "reject-publish" and definition["max-length"] > 0
    bindings = ctl("list_bindings", "source_name", "destination_name", "routing_key")
    assert {"source_name": "nllb.dlx", "destination_name": "nllb.jobs.dead", "routing_key": "nllb.jobs"} in bindings
