"""`nllb-worker` (also `python -m worker`): run | submit | translate | cancel | convert | demo."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, NoReturn

import structlog
from pydantic import SecretStr, ValidationError

from worker.settings import Settings, SettingsFileError, redact_url, settings_error_line, unknown_settings

log = structlog.get_logger("worker")

# The worker's modules are imported by the commands that need them: `--help` stays fast.


# --- run ----------------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    from worker.cli import cpu_threads, load_engine
    from worker.logs import configure
    settings = Settings()
    configure(settings.log_format, settings.log_level)
    log.info("starting nllb-worker", pid=os.getpid(), settings=settings.safe_dump())
    unknown = unknown_settings(os.environ)
    if unknown:
        log.warning("unknown settings ignored", unknown=unknown)
    threads = cpu_threads(settings)
    if threads is not None:
        import torch
        torch.set_num_threads(threads)
    engine = load_engine(settings)
    from engine.heap import settle_heap
    from worker.serve import run_loop, serve
    if settings.broker_processes > 1:
        from worker.processes import Supervisor
        settle_heap()  # the engine's process (each broker process settles its own in serve)
        return Supervisor(settings, engine, args.name).run()
    return run_loop(serve(settings, engine, name=args.name))


# --- convert ------------------------------------------------------------------------------------

def cmd_convert(args: argparse.Namespace) -> int:
    from engine.weights import convert_pytorch_bin
    out = convert_pytorch_bin(Path(args.dir))
    print(f"converted {args.dir}" + (f" -> {out}" if out else ""))
    return 0


# --- demo ---------------------------------------------------------------------------------------

def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _ensure_broker(settings: Settings) -> None:
    from urllib.parse import urlsplit
    u = urlsplit(settings.amqp_url.get_secret_value())
    host, port = u.hostname or "127.0.0.1", u.port or 5672
    if _port_open(host, port):
        return
    print(f"no broker on {host}:{port}; starting one: rabbitmq-server -detached", file=sys.stderr)
    subprocess.run(["rabbitmq-server", "-detached"], check=False)
    for _ in range(120):
        if _port_open(host, port):
            time.sleep(1)
            return
        time.sleep(0.5)
    raise SystemExit(f"the broker did not come up on {host}:{port} within 60 s")


# The toy model's task (engine/assets/toy/README.md): fra_Latn copies the source pieces,
# deu_Latn reverses them, spa_Latn keeps the first half; the fra-reverse adapter makes fra reverse.
DEMO_TEXT = "ta deshacho lidor tu nizela"
DEMO_DOCUMENT = "Dear team,\n\n  ta deshacho lidor. kadera lidor tu.\n\n  - tu nizela\n  - kadera\n"
DEMO_JOBS: list[tuple[str, dict[str, Any]]] = [
    ("greedy, fra_Latn (copies)", {"texts": [DEMO_TEXT, "kadera"], "src_lang": "eng_Latn",
                                   "tgt_lang": "fra_Latn"}),
    ("beam 4, deu_Latn (reverses), 2 hypotheses with scores",
     {"text": DEMO_TEXT, "src_lang": "eng_Latn", "tgt_lang": "deu_Latn",
      "options": {"num_beams": 4, "num_return_sequences": 2, "return_scores": True}}),
    ("greedy, spa_Latn (first half), tokens", {"text": DEMO_TEXT, "src_lang": "eng_Latn", "tgt_lang": "spa_Latn",
                                               "options": {"return_tokens": True}}),
    ("LoRA adapter fra-reverse, fra_Latn (now reverses)",
     {"text": DEMO_TEXT, "src_lang": "eng_Latn", "tgt_lang": "fra_Latn", "adapter": "fra-reverse"}),
    ("bad request: unknown language", {"text": DEMO_TEXT, "src_lang": "eng_Latn", "tgt_lang": "xx_Latn"}),
    ("bad request: unknown option", {"text": DEMO_TEXT, "src_lang": "eng_Latn", "tgt_lang": "fra_Latn",
                                     "options": {"num_beam": 4}}),
    ("a document, deu_Latn: split into sentences, each translated, the layout kept; partial messages show "
     "progress", {"document": DEMO_DOCUMENT, "src_lang": "eng_Latn", "tgt_lang": "deu_Latn",
                  "options": {"progress": True}}),
    ("src_lang auto: the worker identifies the language (detected_lang)",
     {"text": "The weather is nice today and I am going to the park with my friends.", "src_lang": "auto",
      "tgt_lang": "fra_Latn"}),
]


def _show_partial(message: dict[str, Any]) -> None:
    print(f"    partial: {json.dumps(message, ensure_ascii=False)}")


async def _demo_jobs(settings: Settings, queue: str) -> int:
    from worker.client import NllbClient
    async with NllbClient(settings.amqp_url.get_secret_value(), queue, name="nllb-demo") as c:
        for i, (title, body) in enumerate(DEMO_JOBS):
            body = {"v": 1, "id": f"demo-{i + 1}", **body}
            print(f"\n>>> {title}\n    job:   {json.dumps(body, ensure_ascii=False)}")
            fut = await c.publish(body, on_progress=_show_partial)
            reply = await c.wait(fut, 60)
            print(f"    reply: {reply.model_dump_json(exclude_none=True)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    settings = Settings()
    _ensure_broker(settings)
    queue = args.queue
    env = {**os.environ, "NLLB_JOBS_QUEUE": queue, "NLLB_DEAD_LETTER_QUEUE": queue + ".dead",
           "NLLB_METRICS_PORT": str(args.metrics_port), "NLLB_LOG_FORMAT": "json",
           "NLLB_DEVICE": os.environ.get("NLLB_DEVICE", "cpu")}
    if args.toy:  # the bundled toy model and its adapter
        from engine import TOY_ADAPTERS_DIR
        env.pop("NLLB_MODEL", None)
        env["NLLB_ADAPTERS_DIR"] = str(TOY_ADAPTERS_DIR)
    print(f"starting a worker on the {'toy' if args.toy else 'configured'} model, queue {queue!r}",
          file=sys.stderr)
    log_path = Path(args.worker_log)
    with open(log_path, "w") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "worker", "run"], env=env, stdout=logf,
                                stderr=subprocess.STDOUT)
        try:
            _wait_ready(proc, log_path, 180)
            rc = asyncio.run(_demo_jobs(settings, queue))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                wrc = proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                wrc = -9
    print(f"\nworker stopped with SIGTERM, exit code {wrc}; its log: {log_path}", file=sys.stderr)
    return rc if wrc == 0 else 1


def _wait_ready(proc: subprocess.Popen, log_path: Path, timeout: float) -> None:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise SystemExit(f"the worker exited with {proc.returncode}; see {log_path}")
        if '"worker ready"' in log_path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise SystemExit(f"the worker was not ready within {timeout} s; see {log_path}")


# --- argument parsing ---------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    """A mistake in the arguments is one line on stderr and exit status 2 (argparse adds the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def settings_help() -> str:
    """The NLLB_* settings with their defaults and descriptions, from worker.settings.Settings."""
    lines = ["settings: environment variables, or lines of a .env file in the working directory",
             "(.env.example lists them all):"]
    for name, field in Settings.model_fields.items():
        default = field.default
        if isinstance(default, SecretStr):
            default = redact_url(default.get_secret_value())
        lines.append(f"  NLLB_{name.upper()} (default: {'unset' if default is None else default})")
        lines += textwrap.wrap(field.description or "", 96, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from worker.cli import add_job_commands

    ap = Parser(prog="nllb-worker", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="run the worker (settings from NLLB_* environment variables or .env)",
                       description="Consume jobs from the broker and answer them until SIGTERM/SIGINT.",
                       epilog=settings_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="nllb-worker",
                   help="connection name shown by the broker's management tools (default: nllb-worker)")
    p.set_defaults(func=cmd_run)

    add_job_commands(sub)

    p = sub.add_parser("convert", help="convert DIR/pytorch_model.bin to safetensors, once")
    p.add_argument("dir", help="model directory holding pytorch_model.bin")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("demo", help="fresh-machine demo: broker, toy worker, sample jobs")
    p.add_argument("--queue", default="nllb.demo.jobs", help="jobs queue of the demo's worker "
                                                             "(default: nllb.demo.jobs)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="the demo worker's /metrics and /healthz port (default: 0, no HTTP server)")
    p.add_argument("--worker-log", default=str(Path(tempfile.gettempdir()) / "nllb-demo-worker.log"),
                   help="file for the demo worker's log (default: %(default)s)")
    p.add_argument("--configured-model", dest="toy", action="store_false",
                   help="use NLLB_MODEL and NLLB_ADAPTERS_DIR instead of the toy model and its adapter "
                        "(default: off, the toy model)")
    p.set_defaults(func=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    from worker.cli_input import UsageError

    args = build_parser().parse_args(argv)
    prog = f"nllb-worker {args.cmd}"
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        problem = str(e)
    except ValidationError as e:
        if e.title != Settings.__name__:
            raise
        problem = settings_error_line(e)  # a bad NLLB_* value
    except SettingsFileError as e:
        problem = str(e)
    except KeyboardInterrupt:
        return 130
    print(f"{prog}: error: {' '.join(problem.splitlines())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
