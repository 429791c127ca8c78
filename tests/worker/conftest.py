"""Fixtures for worker tests: a real RabbitMQ on 127.0.0.1:5672, unique queue names per test,
the real toy engine (CPU), in-process services and `python -m worker run` subprocesses.

The tests work in a vhost of their own (VHOST), created by the `broker` fixture and deleted with
everything in it (queues, policies, connections) when the session ends; only the tests that
restart the broker touch anything outside it."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import pytest
import structlog

from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
BROKER_URL = os.environ.get("NLLB_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
VHOST = f"nllb-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
AMQP_URL = BROKER_URL.rstrip("/") + "/" + VHOST  # the tests' vhost


def port_open(host: str = "127.0.0.1", port: int = 5672) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def wait_broker(timeout: float = 90.0, url: str = BROKER_URL) -> None:
    """Wait until the broker accepts AMQP connections (not only TCP)."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if port_open():
            try:
                async def probe() -> None:
                    c = await aio_pika.connect(url, timeout=3)
                    await c.close()
                asyncio.run(probe())
                return
            except Exception:  # noqa: BLE001
                pass
        time.sleep(0.5)
    raise RuntimeError("RabbitMQ did not come back")


@pytest.fixture(scope="session")
def broker():
    """The tests' vhost URL: the vhost is made here and deleted, with all in it, at the end."""
    if not port_open():
        subprocess.run(["rabbitmq-server", "-detached"], check=False)
        try:
            wait_broker(60)
        except RuntimeError:
            pytest.skip("no RabbitMQ on 127.0.0.1:5672 and `rabbitmq-server -detached` failed")
    rabbitmqctl("add_vhost", VHOST)
    rabbitmqctl("set_permissions", "-p", VHOST, "guest", ".*", ".*", ".*")
    try:
        yield AMQP_URL
    finally:
        subprocess.run(["rabbitmqctl", "delete_vhost", VHOST], capture_output=True, timeout=120,
                       check=False)


@pytest.fixture(autouse=True)
def structlog_defaults():
    """A test that runs the CLI's main() in this process configures structlog to print to the
    stdout pytest captured for that test; later tests would log to a closed file."""
    yield
    structlog.reset_defaults()


def free_port(span: int = 4) -> int:
    """A port P with P .. P + span - 1 free: a worker with broker processes serves its metrics on P + index in
    each. Below the ephemeral range, where the tests' own connections (AMQP, HTTP) take their local ports, so a
    port picked here is not taken by one of them before the worker binds it."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - span)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + span):
                    stack.enter_context(socket.socket()).bind(("", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no block of free ports below the ephemeral range")


def rabbitmqctl(*args: str, timeout: float = 60) -> str:
    return subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, text=True,
                          timeout=timeout).stdout


def queue_counts(name: str) -> tuple[int, int]:
    """(ready, unacked) of a queue in the tests' vhost, from the broker."""
    out = rabbitmqctl("list_queues", "-p", VHOST, "-q", "--no-table-headers", "name", "messages_ready",
                      "messages_unacknowledged")
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] == name:
            return int(parts[1]), int(parts[2])
    raise KeyError(name)


def settled_counts(name: str, want: tuple[int, int] = (0, 0), timeout: float = 20.0) -> tuple[int, int]:
    """(ready, unacked), polled until it equals `want` (a quorum queue's counters lag a few s)."""
    t_end = time.monotonic() + timeout
    while True:
        counts = queue_counts(name)
        if counts == want or time.monotonic() > t_end:
            return counts
        time.sleep(0.5)


@pytest.fixture
def names(broker: str):
    """Unique topology names for one test; the queues and exchange are deleted afterwards."""
    tag = uuid.uuid4().hex[:10]
    n = {"jobs_queue": f"nllb.test.{tag}", "dead_letter_queue": f"nllb.test.{tag}.dead",
         "dead_letter_exchange": f"nllb.test.{tag}.dlx", "reply_queue": f"nllb.test.{tag}.replies"}
    yield n

    async def cleanup() -> None:
        c = await aio_pika.connect(broker, timeout=10)
        try:
            for q in (n["jobs_queue"], n["dead_letter_queue"], n["reply_queue"]):
                ch = await c.channel()
                with contextlib.suppress(Exception):
                    await ch.queue_delete(q)
            ch = await c.channel()
            with contextlib.suppress(Exception):
                await ch.exchange_delete(n["dead_letter_exchange"])
        finally:
            await c.close()
    with contextlib.suppress(Exception):
        wait_broker(60, broker)
        asyncio.run(cleanup())


@pytest.fixture
def settings(names: dict[str, str], broker: str) -> Settings:
    return Settings(_env_file=None, amqp_url=broker, jobs_queue=names["jobs_queue"],
                    dead_letter_queue=names["dead_letter_queue"],
                    dead_letter_exchange=names["dead_letter_exchange"], metrics_port=0,
                    device="cpu", drain_timeout_s=20, reconnect_interval_s=0.5)


def worker_env(names: dict[str, str], **extra: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NLLB_")}
    env.update({"NLLB_AMQP_URL": AMQP_URL, "NLLB_JOBS_QUEUE": names["jobs_queue"],
                "NLLB_DEAD_LETTER_QUEUE": names["dead_letter_queue"],
                "NLLB_DEAD_LETTER_EXCHANGE": names["dead_letter_exchange"],
                "NLLB_DEVICE": "cpu", "NLLB_METRICS_PORT": str(free_port()),
                "NLLB_LOG_FORMAT": "json", "NLLB_RECONNECT_INTERVAL_S": "0.5",
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


class WorkerProc:
    """`python -m worker run` in a subprocess, its JSON log in a file."""

    def __init__(self, names: dict[str, str], log_dir: Path, tag: str, **env: Any) -> None:
        self.env = worker_env(names, **env)
        self.port = int(self.env["NLLB_METRICS_PORT"])
        self.log_path = log_dir / f"worker-{tag}.log"
        self._logf = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "worker", "run", "--name", f"w-{tag}"],
                                     cwd=ROOT, env=self.env, stdout=self._logf,
                                     stderr=subprocess.STDOUT)

    def log_lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
        return out

    def wait_ready(self, timeout: float = 120) -> None:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited {self.proc.returncode}:\n"
                                   + self.log_path.read_text()[-3000:])
            if any(x.get("event") == "worker ready" for x in self.log_lines()):
                return
            time.sleep(0.1)
        raise TimeoutError("worker not ready:\n" + self.log_path.read_text()[-3000:])

    def http(self, path: str, broker_process: int = 0) -> tuple[int, str]:
        """GET `path` from the health endpoints of one broker process (each serves its own, on port + its index)."""
        import urllib.error
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port + broker_process}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def ready(self, broker_process: int = 0) -> bool:
        """Whether one broker process answers /readyz with 200 (False while its endpoint is not listening)."""
        try:
            return self.http("/readyz", broker_process)[0] == 200
        except OSError:  # refused or reset while the process restarts its server
            return False

    def count(self, event: str, **match: Any) -> int:
        return sum(1 for x in self.log_lines() if x.get("event") == event
                   and all(x.get(k) == v for k, v in match.items()))

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._logf.close()

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self._logf.close()

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._logf.close()


@pytest.fixture
def spawn(names: dict[str, str], tmp_path: Path):
    procs: list[WorkerProc] = []

    def _spawn(tag: str = "", **env: Any) -> WorkerProc:
        p = WorkerProc(names, tmp_path, tag or str(len(procs)), **env)
        procs.append(p)
        return p
    yield _spawn
    for p in procs:
        p.cleanup()


@pytest.fixture(scope="session")
def engine(toy_engine):
    """The real engine on the bundled toy model, CPU: the session's `toy_engine` (tests/conftest.py)."""
    return toy_engine


def run(coro: Any, timeout: float) -> Any:
    """Run an async test body with a hard timeout."""
    async def guarded() -> Any:
        return await asyncio.wait_for(coro, timeout)
    return asyncio.run(guarded())
