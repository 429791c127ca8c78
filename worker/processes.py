"""The engine's process when NLLB_BROKER_PROCESSES = N > 1: it loads the engine, starts N broker processes
(each the whole worker `Service` on an `EngineClient`, worker/engine_link.py), and looks after them.

- Signals reach this process; it relays each to every broker process, which ignore their own: a terminal's
  Ctrl-C (the whole process group) or a SIGTERM sent to every process of the unit would otherwise count twice.
  The first drains them, a second cuts their drains short, as for one process.
- A broker process that exits while the worker is not stopping is started again after
  NLLB_RECONNECT_INTERVAL_S: its unacked deliveries went back to the queue with its connection, and its jobs
  in the engine were cancelled. One that exits 78 (the broker's queues were declared with other arguments, or
  its metrics port, NLLB_METRICS_PORT + its index, is taken) stops the worker with 78, as one process does; so
  does one that exits UNREADY_EXITS_MAX times in a row before it ever consumed (it fails at start-up: starting
  it again meets the same).
- systemd: READY=1 once every broker process consumes; WATCHDOG=1 while the engine is alive and every
  broker process said, within the last HEARTBEAT_S * 3, that its event loop and engine are healthy;
  STOPPING=1 at the first signal.
- A broker process still alive NLLB_DRAIN_TIMEOUT_S + STOP_MARGIN_S after the stop (ABANDON_S after a second
  signal) is killed: a stuck process cannot hold the worker up, and its unacked jobs return to the queue.
- Once every broker process has exited after a stop, the engine is closed.
"""
from __future__ import annotations

import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import structlog

from worker.engine_api import EngineAPI
from worker.engine_client import EngineClient
from worker.engine_link import HEARTBEAT_S, STATS_INTERVAL_S, EngineLinks, EngineServer, drain_wake
from worker.health import sd_notify, watchdog_interval_s
from worker.serve import EX_CONFIG, STOP_SIGNALS, run_loop, serve
from worker.settings import Settings

log = structlog.get_logger("worker.processes")

STOP_MARGIN_S = 30.0  # beyond NLLB_DRAIN_TIMEOUT_S, for a broker process to hand back and confirm what is left
ABANDON_S = 5.0  # after a second signal, for a broker process to close its connection and exit
UNREADY_EXITS_MAX = 3  # a broker process's exits in a row before it consumed, after which the worker stops


@dataclass(eq=False)
class BrokerProcess:
    index: int
    process: BaseProcess
    server: EngineServer | None = None
    ready: bool = False  # it consumes (it said so once)
    healthy_at: float = 0.0  # time.monotonic() of its last healthy heartbeat


class Supervisor:
    """Runs on the engine's process's main thread: `run()` until the broker processes have stopped."""

    def __init__(self, settings: Settings, engine: EngineAPI, name: str) -> None:
        self.settings, self.engine, self.name = settings, engine, name
        self._spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: this process has threads
        self._procs: list[BrokerProcess | None] = [None] * settings.broker_processes
        self._links = EngineLinks()  # the threads that read and write every broker process's pipe
        self._restart_at: dict[int, float] = {}  # index -> when to start it again
        self._unready_exits: dict[int, int] = {}  # index -> its exits in a row before it consumed
        self._wake_r, self._wake_w = os.pipe()  # signals and broker messages end the main thread's wait
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._signals: list[int] = []
        self._stopping = False
        self._kill_at: float | None = None  # after a stop, broker processes still alive then are killed
        self._status = 0
        self._announced = False
        self._done = threading.Event()

    def run(self) -> int:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        try:
            for i in range(len(self._procs)):
                self._start(i)
            threading.Thread(target=self._push_stats, name="nllb-stats-push", daemon=True).start()
            self._supervise()
        except BaseException:  # a failure here: the broker processes' jobs go back to the queue
            for p in self._live():
                p.process.kill()
            self.engine.close()
            raise
        finally:
            self._done.set()
        if self._status > 128:  # a second signal: now, not after the engine's work
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(self._status)
        self.engine.close()
        log.info("stopped", broker_processes=len(self._procs))
        return self._status

    def _supervise(self) -> None:
        watchdog = watchdog_interval_s()
        next_pet = 0.0
        while not (self._stopping and not self._live()):
            waits: list[Any] = [p.process.sentinel for p in self._live()] + [self._wake_r]
            multiprocessing.connection.wait(waits, timeout=min(1.0, watchdog or 1.0))
            drain_wake(self._wake_r)
            self._take_signals()
            self._kill_overdue()
            self._reap()
            self._restart_due()
            self._announce_ready()
            if watchdog is not None and time.monotonic() >= next_pet:
                self._pet()
                next_pet = time.monotonic() + watchdog

    def _live(self) -> list[BrokerProcess]:
        return [p for p in self._procs if p is not None]

    # --- broker processes ---------------------------------------------------------------------

    def _start(self, index: int, restarted: bool = False) -> None:
        ours, theirs = self._spawn.Pipe()
        process = self._spawn.Process(target=broker_process,
                                      args=(theirs, self.settings, self.name, index, restarted),
                                      name=f"{self.name}-broker-{index}")
        process.start()
        theirs.close()
        proc = BrokerProcess(index, process)
        proc.server = EngineServer(self.engine, ours, partial(self._on_message, proc), self._links)
        proc.server.send(("stats", self.engine.stats(), self.engine.is_alive()))  # its first, before it consumes
        self._procs[index] = proc
        log.info("broker process started", index=index, pid=process.pid)

    def _reap(self) -> None:
        for proc in self._live():
            if proc.process.is_alive():
                continue
            proc.process.join()
            code = proc.process.exitcode
            self._procs[proc.index] = None
            unready_exits = 0 if proc.ready else self._unready_exits.get(proc.index, 0) + 1
            self._unready_exits[proc.index] = unready_exits
            if self._stopping:
                log.info("broker process exited", index=proc.index, status=code)
            elif code == EX_CONFIG:  # starting it again would meet the same; the process logged which
                log.error("a broker process cannot run with these settings (its error above says why); stopping",
                          index=proc.index)
                self._status = EX_CONFIG
                self._stop(signal.SIGTERM)
            elif unready_exits >= UNREADY_EXITS_MAX:
                log.error("a broker process exited before it consumed, again and again (its error above says why); "
                          "stopping", index=proc.index, status=code, exits=unready_exits)
                self._status = EX_CONFIG
                self._stop(signal.SIGTERM)
            else:
                log.error("broker process exited unexpectedly; starting it again", index=proc.index, status=code,
                          after_s=self.settings.reconnect_interval_s)
                self._restart_at[proc.index] = time.monotonic() + self.settings.reconnect_interval_s

    def _restart_due(self) -> None:
        now = time.monotonic()
        for index, at in list(self._restart_at.items()):
            if at <= now:
                del self._restart_at[index]
                try:
                    self._start(index, restarted=True)
                except OSError as e:  # no process to be had now (memory, process limits): later
                    log.error("starting a broker process failed; trying again", index=index, error=repr(e))
                    self._restart_at[index] = now + self.settings.reconnect_interval_s

    def _on_message(self, proc: BrokerProcess, message: tuple[Any, ...]) -> None:
        """A broker process's ready or heartbeat (its server's reader thread)."""
        if message[0] == "ready":
            proc.ready = True
            self._wake()
        elif message[0] == "heartbeat" and message[1]:
            proc.healthy_at = time.monotonic()

    def _announce_ready(self) -> None:
        if self._announced or self._stopping or not all(p is not None and p.ready for p in self._procs):
            return
        self._announced = True
        sd_notify("READY=1")
        log.info("worker ready", queue=self.settings.jobs_queue, broker_processes=len(self._procs))

    def _pet(self) -> None:
        now = time.monotonic()
        if self.engine.is_alive() and all(p is not None and now - p.healthy_at < 3 * HEARTBEAT_S
                                          for p in self._procs):
            sd_notify("WATCHDOG=1")
        else:
            log.warning("watchdog withheld: the engine or a broker process unhealthy")

    def _push_stats(self) -> None:
        while not self._done.wait(STATS_INTERVAL_S):
            try:
                stats, alive = self.engine.stats(), self.engine.is_alive()
            except Exception as e:  # noqa: BLE001 - the broker processes see stale stats and turn unready
                log.warning("engine stats failed", error=repr(e))
                continue
            for proc in self._live():
                if proc.server is not None:
                    proc.server.send(("stats", stats, alive))

    # --- signals ------------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals.append(signum)
        self._wake()

    def _take_signals(self) -> None:
        while self._signals:
            sig = signal.Signals(self._signals.pop(0))
            if not self._stopping:
                log.info("signal received: graceful stop of every broker process", signal=sig.name)
                sd_notify("STOPPING=1")
            else:
                log.warning("second signal: the broker processes exit without draining; the jobs not yet "
                            "answered go back to the queue", signal=sig.name)
                self._status = 128 + sig.value
                self._kill_at = min(self._kill_at or math.inf, time.monotonic() + ABANDON_S)
            self._stop(sig)

    def _stop(self, sig: signal.Signals) -> None:
        if not self._stopping:  # a drain, its replies' confirms, and a margin
            self._kill_at = time.monotonic() + self.settings.drain_timeout_s + STOP_MARGIN_S
        self._stopping = True
        self._restart_at.clear()
        for proc in self._live():
            if proc.server is not None:
                proc.server.send(("stop", sig.value))

    def _kill_overdue(self) -> None:
        """A broker process that outlives its stop's time is stuck: killed, its unacked jobs go back to the queue
        with its connection."""
        if self._kill_at is None or time.monotonic() < self._kill_at:
            return
        for proc in self._live():
            if proc.process.is_alive():
                log.error("broker process did not stop in time; killing it", index=proc.index)
                proc.process.kill()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass  # a wake-up is pending already


def broker_process(conn: Connection, settings: Settings, name: str, index: int, restarted: bool = False) -> None:
    """A broker process's main: the worker's Service, its engine the pipe to the engine's process. systemd's
    variables are dropped (the engine's process speaks for the unit) and stop signals ignored (relayed). One
    `restarted` while the worker serves waits, not ready, for a jobs queue declared otherwise to match again, as
    the running processes do, where one at the worker's start exits 78."""
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        os.environ.pop(var, None)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    from worker.logs import configure
    configure(settings.log_format, settings.log_level)
    if settings.metrics_port:
        settings = settings.model_copy(update={"metrics_port": settings.metrics_port + index})
    try:
        client = EngineClient(conn, check_outputs=settings.output_warnings)
    except (EOFError, OSError):
        log.error("the engine's process went away before this broker process started")
        sys.exit(1)
    sys.exit(run_loop(serve(settings, client, name=f"{name}-{index}", parent=client,
                            mismatch_exits=not restarted)))
