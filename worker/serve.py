"""The worker's main coroutine: a Service on an engine until a stop, with its health endpoints and systemd's
notifications; in one process (`nllb-worker run`), or in each broker process (worker/processes.py)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import structlog

from engine.heap import settle_heap
from worker.settings import Settings

if TYPE_CHECKING:
    from worker.engine_api import EngineAPI
    from worker.engine_client import EngineClient
    from worker.health import Health
    from worker.service import Service

log = structlog.get_logger("worker")

EX_CONFIG = 78  # settings the worker cannot run with: queues declared otherwise, a refusal, a metrics port taken
CONNECT_TIMEOUT_S = 30.0  # one attempt at the first connection, from TCP to consuming
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stops:
    """The worker's stop requests: the first (a signal, the engine's process relaying one, or the engine lost)
    starts the drain; a second signal while it drains cuts it short."""

    def __init__(self, service: Service):
        self.service = service
        self.requested = asyncio.Event()
        self.second: asyncio.Future[signal.Signals] = asyncio.get_running_loop().create_future()

    async def listen(self, parent: EngineClient | None) -> None:
        """Take this process's signals, or, in a broker process, the stops its engine's process relays."""
        loop = asyncio.get_running_loop()
        if parent is None:
            for sig in STOP_SIGNALS:
                loop.add_signal_handler(sig, self.on_signal, sig)
            return
        parent.listen(lambda signum: loop.call_soon_threadsafe(self.on_signal, signal.Signals(signum)),
                      lambda: loop.call_soon_threadsafe(self.without_engine))
        await asyncio.sleep(0)  # a stop or loss that came during start-up is delivered through the loop: now

    def on_signal(self, sig: signal.Signals) -> None:
        from worker.health import sd_notify

        if self.requested.is_set():
            if not self.second.done():
                self.second.set_result(sig)
            return
        log.info("signal received: graceful stop", signal=sig.name)
        sd_notify("STOPPING=1")
        self.requested.set()
        self.service.stop()

    def without_engine(self) -> None:
        """The engine's process is gone: its jobs have failed with EngineFailure and go back to the queue."""
        if not self.requested.is_set():
            self.requested.set()
            self.service.stop()


async def serve(settings: Settings, engine: EngineAPI, name: str = "nllb-worker",
                parent: EngineClient | None = None, mismatch_exits: bool = True) -> int:
    """Run the worker until SIGTERM/SIGINT, then drain. Exit status: 0 after a drain; 78
    (EX_CONFIG) at once when the broker's queues were declared with other arguments, the broker refuses this
    worker's credentials or permissions, or the metrics port is taken (retrying here would meet the
    same; the supervisor decides); 128 + the
    signal's number when a second signal cut the drain short. `parent`: this is a broker process
    (worker/processes.py) whose engine is `parent`; its stops come from the engine's process, which
    also hears when it is ready and, every HEARTBEAT_S, whether it is healthy (for systemd). `mismatch_exits`
    False: queues declared otherwise are waited for at the first connection (connect_first), not 78."""
    from worker.health import Health, LoopMonitor, sd_notify
    from worker.metrics import Metrics
    from worker.service import Service

    # 1. the service and its health endpoints
    metrics = Metrics()
    service = Service(settings, engine, metrics, name=name)
    monitor = LoopMonitor(metrics)
    monitor.start()
    health = Health(metrics, monitor, service.ready, service.engine_ok)
    if not await bind_metrics_port(health, settings):
        await monitor.stop()
        await service.close_engine()
        return EX_CONFIG
    settle_heap()

    # 2. stops, then the first connection
    stops = Stops(service)
    await stops.listen(parent)
    status = await connect_first(service, settings, stops.requested, mismatch_exits=mismatch_exits)
    if status is not None:
        await service.close_engine()
        return status

    # 3. serving until the first stop
    sd_notify("READY=1")
    health.start_watchdog()
    beats = None
    if parent is None:
        log.info("worker ready", queue=settings.jobs_queue, prefetch=service.prefetch)
    else:
        log.info("broker process ready", queue=settings.jobs_queue, prefetch=service.prefetch)
        parent.announce_ready()
        beats = asyncio.create_task(heartbeats(parent, lambda: health.alive() and service.engine_ok()))
    await stops.requested.wait()
    if beats is not None:
        beats.cancel()

    # 4. the drain, unless a second signal comes first
    await drain(service, stops.second)
    await health.stop()
    await monitor.stop()
    return 0


async def bind_metrics_port(health: Health, settings: Settings) -> bool:
    """Serve the health endpoints when a port is set; False (logged with the fix) when it cannot be bound."""
    if not settings.metrics_port:
        return True
    try:
        await health.start_http(settings.metrics_host, settings.metrics_port)
    except OSError as e:
        log.error("the metrics port cannot be bound; exiting", host=settings.metrics_host,
                  port=settings.metrics_port, error=repr(e),
                  fix="free it, or set NLLB_METRICS_PORT to a free port (broker processes take it + 0..N-1)")
        return False
    return True


async def connect_first(service: Service, settings: Settings, stop: asyncio.Event,
                        timeout_s: float = CONNECT_TIMEOUT_S, mismatch_exits: bool = True) -> int | None:
    """Keep trying the first connection (a container may start before its broker) until it consumes (None)
    or a stop comes first (0), an attempt given up after `timeout_s` (an endpoint that takes the TCP connection
    but never answers AMQP would hold it forever); EX_CONFIG when the broker's queues were declared otherwise
    or it refuses this worker's credentials or permissions. Broker.connect closes a failed attempt's
    connection, so retrying never holds two. `mismatch_exits` False: a mismatch is logged once and the
    connection tried again every TOPOLOGY_CHECK_S, as a running worker waits for its queues to match."""
    from aiormq.exceptions import AMQPError

    from worker.amqp import CONNECTION_ERRORS
    from worker.topology import (
        TOPOLOGY_CHECK_S,
        WAITING_FOR_MATCH,
        TopologyMismatch,
        connection_hint,
        describe_refusal,
    )

    mismatch: str | None = None  # the last one logged
    while not stop.is_set():
        try:
            if not await start_unless_stopped(service, stop, timeout_s):
                return 0
            return None
        except TopologyMismatch as e:
            if mismatch_exits:
                log.error("the broker's topology does not match this worker's settings; exiting", error=str(e))
                return EX_CONFIG
            if str(e) != mismatch:
                log.error(WAITING_FOR_MATCH, error=str(e))
            mismatch = str(e)
            pause_s = TOPOLOGY_CHECK_S
        except CONNECTION_ERRORS + (OSError, AMQPError) as e:
            if (refusal := describe_refusal(e)) is not None:
                log.error("the broker refuses this worker; exiting", error=refusal)
                return EX_CONFIG
            log.warning("broker not reachable; retrying", error=repr(e), hint=connection_hint(e),
                        url=settings.amqp_url_redacted(), every_s=settings.reconnect_interval_s)
            pause_s = settings.reconnect_interval_s
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), pause_s)
    return 0  # stopped before it ever consumed (during start-up or between attempts)


async def start_unless_stopped(service: Service, stop: asyncio.Event, timeout_s: float) -> bool:
    """service.start() (True), given up with TimeoutError after `timeout_s`; False when a stop comes first, the
    attempt cancelled and its connection closed."""
    starting = asyncio.ensure_future(asyncio.wait_for(service.start(), timeout_s))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if starting.done():
        starting.result()
        return True
    starting.cancel()
    with contextlib.suppress(BaseException):
        await starting
    await service.broker.close()
    return False


async def drain(service: Service, second: asyncio.Future[signal.Signals]) -> None:
    """Finish the jobs in flight and close; a second signal before that exits the process at once with
    128 + its number (the unanswered jobs go back to the queue as the connection closes)."""
    draining = asyncio.ensure_future(service.shutdown())
    await asyncio.wait({draining, second}, return_when=asyncio.FIRST_COMPLETED)
    if draining.done():
        return
    sig = second.result()
    log.warning("second signal: exiting now, without draining; the jobs not yet answered go "
                "back to the queue as the connection closes", signal=sig.name, jobs=service.in_flight())
    with contextlib.suppress(Exception):
        await service.abandon()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + sig.value)  # now: not after the engine's and worker threads' work


async def heartbeats(parent: EngineClient, healthy: Callable[[], bool]) -> None:
    """A broker process's health, told to the engine's process (which pets systemd's watchdog for all)."""
    from worker.engine_link import HEARTBEAT_S
    with contextlib.suppress(Exception):  # the engine's process is gone: on_lost stops this process
        while True:
            parent.heartbeat(healthy())
            await asyncio.sleep(HEARTBEAT_S)


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run the worker's coroutine on uvloop (its I/O and thread wake-ups cost the loop thread
    less, and it holds the GIL through a socket write), or on asyncio's own loop without it."""
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed: running on asyncio's own event loop (slower)")
        return asyncio.run(main)
    return uvloop.run(main)
