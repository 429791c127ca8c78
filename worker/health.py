"""Liveness, readiness, systemd notify/watchdog and the HTTP endpoints, all on the event loop.

- `/healthz`: 200 while the process is alive and its event loop responsive (the loop itself
  answers, and the lag monitor ticked within `STALE_TICK_S`).
- `/readyz`: 200 when connected to the broker, consuming, and the engine is up.
- `/metrics`: Prometheus text format.
- systemd: READY=1 once consuming starts, WATCHDOG=1 every WATCHDOG_USEC/2 only while the loop
  and the engine are healthy, STOPPING=1 on shutdown. Plain datagrams to $NOTIFY_SOCKET (path or
  abstract '@name'); no dependency.
"""
from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import deque
from collections.abc import Callable

import structlog

from worker.metrics import Metrics

log = structlog.get_logger("worker.health")

LAG_INTERVAL_S = 0.05
STALE_TICK_S = 5.0
UNHEALTHY_LAG_S = 2.0


def sd_notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1") to systemd; False when not under systemd (no NOTIFY_SOCKET)."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError as e:
        log.warning("sd_notify failed", state=state, error=str(e))
        return False


def watchdog_interval_s() -> float | None:
    """Half of WATCHDOG_USEC when systemd's watchdog is on for this process, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.strip() != str(os.getpid())):
        return None
    try:
        return max(int(usec) / 2e6, 0.01)
    except ValueError:
        return None


class LoopMonitor:
    """Measures event-loop lag: how late a short timer fires. Feeds the metrics."""

    def __init__(self, metrics: Metrics, interval: float = LAG_INTERVAL_S) -> None:
        self.metrics = metrics
        self.interval = interval
        self.last_tick = time.monotonic()
        self.max_lag = 0.0  # since start (tests read it)
        self._recent: deque[tuple[float, float]] = deque()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-monitor")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(self.interval)
            now = time.monotonic()
            lag = max(0.0, now - t0 - self.interval)
            self.last_tick = now
            self.max_lag = max(self.max_lag, lag)
            self.metrics.loop_lag.observe(lag)
            self._recent.append((now, lag))
            while self._recent and self._recent[0][0] < now - 10:
                self._recent.popleft()
            self.metrics.loop_lag_max.set(max(x for _, x in self._recent))

    def healthy(self) -> bool:
        recent = max((x for _, x in self._recent), default=0.0)
        return time.monotonic() - self.last_tick < STALE_TICK_S and recent < UNHEALTHY_LAG_S


class Health:
    """HTTP endpoints + systemd watchdog. `ready()` and `engine_ok()` come from the service."""

    def __init__(self, metrics: Metrics, monitor: LoopMonitor, ready: Callable[[], bool],
                 engine_ok: Callable[[], bool]) -> None:
        self.metrics = metrics
        self.monitor = monitor
        self.ready = ready
        self.engine_ok = engine_ok
        self._server: asyncio.AbstractServer | None = None
        self._watchdog: asyncio.Task | None = None
        self.port: int | None = None

    def alive(self) -> bool:
        return self.monitor.healthy()

    async def start_http(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("http endpoints up", host=host, port=self.port,
                 paths=["/healthz", "/readyz", "/metrics"])

    def start_watchdog(self) -> None:
        interval = watchdog_interval_s()
        if interval is None:
            return
        log.info("systemd watchdog on", every_s=interval)
        self._watchdog = asyncio.get_running_loop().create_task(self._pet(interval), name="watchdog")

    async def _pet(self, interval: float) -> None:
        while True:
            if self.alive() and self.engine_ok():
                sd_notify("WATCHDOG=1")
            else:
                log.warning("watchdog withheld: loop or engine unhealthy")
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        if self._watchdog:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        if self._server:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            path = line[1].split("?", 1)[0] if len(line) >= 2 else "/"
            ctype = "text/plain; charset=utf-8"
            if path == "/healthz":
                ok = self.alive()
                status, body = (200, b"ok\n") if ok else (503, b"event loop unresponsive\n")
            elif path == "/readyz":
                ok = self.ready()
                self.metrics.ready.set(1 if ok else 0)
                status, body = (200, b"ready\n") if ok else (503, b"not ready\n")
            elif path == "/metrics":
                self.metrics.ready.set(1 if self.ready() else 0)
                status, body = 200, self.metrics.render()
                ctype = "text/plain; version=0.0.4; charset=utf-8"
            else:
                status, body = 404, b"not found; try /healthz /readyz /metrics\n"
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, asyncio.LimitOverrunError,
                ConnectionError):
            pass
        finally:
            writer.close()
