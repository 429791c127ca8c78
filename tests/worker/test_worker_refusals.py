"""The first connection: a broker that refuses this worker for good (credentials, permissions) stops it with 78
and one line naming the fix, where retrying would meet the same; one that closes the connection as it is opened
(no reason comes with it: a vhost missing, or at its connection limit, which passes) is retried with a hint; an
endpoint that takes the TCP connection but never speaks AMQP is given up after a timeout and retried, and a stop
meanwhile ends the worker at once."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest
from pydantic import SecretStr
from conftest import AMQP_URL, run
from structlog.testing import capture_logs

from worker.metrics import Metrics
from worker.serve import EX_CONFIG, connect_first
from worker.service import Service

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(120)]

REFUSES = "the broker refuses this worker; exiting"


def with_url_part(url: str, **part: str) -> str:
    parts = urlsplit(url)._replace(**part)
    return urlunsplit(parts)


@contextlib.contextmanager
def silent_endpoint() -> Iterator[int]:
    """A TCP port that accepts connections and never sends a byte (another service, a proxy with nothing
    behind it): its port."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


@pytest.mark.parametrize("case, words", [
    ("password", ["user name or password", "NLLB_AMQP_URL"]),
    ("reserved_queue_name", ["refused access", "amq."]),
])
def test_a_broker_that_refuses_the_worker_stops_it_with_78_and_the_fix(spawn, case, words):
    env = {"password": {"NLLB_AMQP_URL": with_url_part(AMQP_URL, netloc="guest:wrong@127.0.0.1:5672")},
           "reserved_queue_name": {"NLLB_JOBS_QUEUE": "amq.nllb-jobs"}}[case]
    w = spawn(case, **env)
    assert w.proc.wait(60) == EX_CONFIG
    errors = [x["error"] for x in w.log_lines() if x.get("event") == REFUSES]
    assert len(errors) == 1 and all(word in errors[0] for word in words), errors
    assert "wrong" not in w.log_path.read_text(), "the password reached the log"
    assert w.count("broker not reachable; retrying") == 0


def test_a_vhost_the_broker_will_not_open_is_retried_with_a_hint(spawn):
    w = spawn("vhost", NLLB_AMQP_URL=with_url_part(AMQP_URL, path="/nllb-test-no-such-vhost"),
              NLLB_RECONNECT_INTERVAL_S="0.2")
    t_end = time.monotonic() + 60
    while w.count("broker not reachable; retrying") < 3 and time.monotonic() < t_end:
        time.sleep(0.2)
    retries = [x for x in w.log_lines() if x.get("event") == "broker not reachable; retrying"]
    assert len(retries) >= 3 and all("connection limit" in x["hint"] and "vhost" in x["hint"] for x in retries)
    assert w.terminate(10) == 0


def test_sigterm_stops_a_worker_whose_broker_never_answers_at_once(spawn):
    with silent_endpoint() as port:
        w = spawn("silent", NLLB_AMQP_URL=f"amqp://guest:guest@127.0.0.1:{port}/")
        t_end = time.monotonic() + 60
        while not w.count("connecting") and time.monotonic() < t_end:
            time.sleep(0.1)
        assert w.count("connecting") == 1
        time.sleep(0.5)  # into the attempt that never ends
        t0 = time.monotonic()
        assert w.terminate(10) == 0
        assert time.monotonic() - t0 < 5


def test_a_first_connection_that_never_answers_is_given_up_and_tried_again(settings, engine):
    async def body() -> None:
        with silent_endpoint() as port:
            url = f"amqp://guest:guest@127.0.0.1:{port}/"
            service = Service(settings.model_copy(update={"amqp_url": SecretStr(url), "reconnect_interval_s": 0.1}),
                              engine, Metrics(), owns_engine=False)
            stop = asyncio.Event()
            attempts = asyncio.ensure_future(connect_first(service, service.settings, stop, timeout_s=0.3))
            await asyncio.sleep(1.5)
            assert not attempts.done()
            stop.set()
            assert await asyncio.wait_for(attempts, 5) == 0
    with capture_logs() as logs:
        run(body(), 30)
    retries = [x for x in logs if x["event"] == "broker not reachable; retrying"]
    assert len(retries) >= 3 and all("TimeoutError" in x["error"] for x in retries)
