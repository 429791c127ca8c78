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

log = structlog.get_logger("worker")

EX_CONFIG = 78  # settings the worker cannot run with: queues declared otherwise, or a metrics port taken
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
async def serve(settings: Settings, engine: EngineAPI, name: str = "nllb-worker",
                parent: EngineClient | None = None) -> int:
    """Run the worker until SIGTERM/SIGINT, then drain. Exit status: 0 after a drain; 78
    (EX_CONFIG) at once when the broker's queues were declared with other arguments or the metrics port is
    taken (retrying here would meet the same; the supervisor decides); 128 + the
    signal's number when a second signal cut the drain short. `parent`: this is a broker process
    (worker/processes.py) whose engine is `parent`; its stops come from the engine's process, which
    also hears when it is ready and, every HEARTBEAT_S, whether it is healthy (for systemd)."""
    from worker.amqp import CONNECTION_ERRORS, TopologyMismatch
    from worker.health import Health, LoopMonitor, sd_notify
    from worker.metrics import Metrics
    from worker.service import Service

    loop = asyncio.get_running_loop()
    metrics = Metrics()
    service = Service(settings, engine, metrics, name=name)
    monitor = LoopMonitor(metrics)
    monitor.start()
    health = Health(metrics, monitor, service.ready, service.engine_ok)
    if settings.metrics_port:
        try:
            await health.start_http(settings.metrics_host, settings.metrics_port)
        except OSError as e:
            log.error("the metrics port cannot be bound; exiting", host=settings.metrics_host,
                      port=settings.metrics_port, error=repr(e),
                      fix="free it, or set NLLB_METRICS_PORT to a free port (broker processes take it + 0..N-1)")
            await monitor.stop()
            await service.close_engine()
            return EX_CONFIG

    settle_heap()

    stop = asyncio.Event()
    second: asyncio.Future[signal.Signals] = loop.create_future()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            if not second.done():
                second.set_result(sig)
            return
        log.info("signal received: graceful stop", signal=sig.name)
        sd_notify("STOPPING=1")
        stop.set()
        service.stop()

    def stop_without_engine() -> None:  # its jobs have failed with EngineFailure: they go back to the queue
        if not stop.is_set():
            stop.set()
            service.stop()

    if parent is None:
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
    else:
        parent.listen(lambda signum: loop.call_soon_threadsafe(on_signal, signal.Signals(signum)),
                      lambda: loop.call_soon_threadsafe(stop_without_engine))
        await asyncio.sleep(0)  # a stop or loss that came during start-up is delivered through the loop: now

    # The first connection: keep trying (a container may start before its broker) until stopped;
    # Broker.connect closes a failed attempt's connection, so retrying never holds two.
    while True:
        if stop.is_set():  # stopped before it ever consumed (during start-up or between attempts)
            await service.close_engine()
            return 0
        try:
            await service.start()
            break
        except TopologyMismatch as e:
            log.error("the broker's topology does not match this worker's settings; exiting",
                      error=str(e))
            await service.close_engine()
            return EX_CONFIG
        except CONNECTION_ERRORS + (OSError,) as e:
            log.warning("broker not reachable; retrying", error=repr(e),
                        url=settings.amqp_url_redacted(), every_s=settings.reconnect_interval_s)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), settings.reconnect_interval_s)
    sd_notify("READY=1")
    health.start_watchdog()
    beats = None
    if parent is None:
        log.info("worker ready", queue=settings.jobs_queue, prefetch=service.prefetch)
    else:
        log.info("broker process ready", queue=settings.jobs_queue, prefetch=service.prefetch)
        parent.announce_ready()
        beats = loop.create_task(heartbeats(parent, lambda: health.alive() and service.engine_ok()))
    await stop.wait()
    if beats is not None:
        beats.cancel()
    drain = asyncio.ensure_future(service.shutdown())
    await asyncio.wait({drain, second}, return_when=asyncio.FIRST_COMPLETED)
    if not drain.done():
        sig = second.result()
        log.warning("second signal: exiting now, without draining; the jobs not yet answered go "
                    "back to the queue as the connection closes", signal=sig.name,
                    jobs=service.in_flight())
        with contextlib.suppress(Exception):
            await service.abandon()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + sig.value)  # now: not after the engine's and worker threads' work
    await health.stop()
    await monitor.stop()
    return 0


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
