"""`nllb-worker` (also `python -m worker`): run | submit | translate | convert | demo."""
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
import time
from pathlib import Path
from typing import Any

import structlog

from worker.settings import Settings

log = structlog.get_logger("worker")


# --- engine -------------------------------------------------------------------------------------

def load_engine(settings: Settings, model: Path | None = None) -> Any:
    from engine import Engine
    kwargs: dict[str, Any] = {"model_dir": model if model is not None else settings.model,
                              "device": settings.device, "max_rows": settings.max_rows,
                              "adapters_dir": settings.adapters_dir}
    if settings.max_adapters is not None:
        kwargs["max_adapters"] = settings.max_adapters
    if settings.max_lora_rank is not None:
        kwargs["max_lora_rank"] = settings.max_lora_rank
    t0 = time.monotonic()
    engine = Engine.load(**kwargs)
    log.info("engine loaded", model=engine.model_name, rows_total=engine.rows_total,
             max_source_tokens=engine.max_source_tokens, device=settings.device,
             load_s=round(time.monotonic() - t0, 3))
    return engine


# --- run ----------------------------------------------------------------------------------------

async def serve(settings: Settings, engine: Any, name: str = "nllb-worker") -> int:
    from worker.amqp import CONNECTION_ERRORS
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
        await health.start_http(settings.metrics_host, settings.metrics_port)

    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("second signal: already stopping", signal=sig.name)
        log.info("signal received: graceful stop", signal=sig.name)
        sd_notify("STOPPING=1")
        stop.set()
        service.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    # The first connection: keep trying (a container may start before its broker) until stopped.
    while True:
        try:
            await service.start()
            break
        except CONNECTION_ERRORS + (OSError,) as e:
            log.warning("broker not reachable; retrying", error=repr(e),
                        url=settings.amqp_url_redacted(), every_s=settings.reconnect_interval_s)
            try:
                await asyncio.wait_for(stop.wait(), settings.reconnect_interval_s)
            except asyncio.TimeoutError:
                continue
            await service.close_engine()
            return 0
    sd_notify("READY=1")
    health.start_watchdog()
    log.info("worker ready", queue=settings.jobs_queue, prefetch=service.prefetch)
    await stop.wait()
    await service.shutdown()
    await health.stop()
    await monitor.stop()
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from worker.logs import configure
    settings = Settings()
    configure(settings.log_format, settings.log_level)
    log.info("starting nllb-worker", pid=os.getpid(), settings=settings.safe_dump())
    engine = load_engine(settings)
    return asyncio.run(serve(settings, engine, name=args.name))


# --- submit -------------------------------------------------------------------------------------

def _read_texts(args: argparse.Namespace) -> tuple[list[str], bool]:
    if getattr(args, "file", None):
        path = args.file
        lines = (sys.stdin if path == "-" else open(path, encoding="utf-8")).read().splitlines()
        return [line for line in lines if line.strip()], True
    if args.texts:
        return list(args.texts), False
    if not sys.stdin.isatty():
        return [line for line in sys.stdin.read().splitlines() if line.strip()], True
    raise SystemExit("no texts: give them as arguments, with --file PATH, or on stdin")


def _options(args: argparse.Namespace) -> dict[str, Any] | None:
    if not args.options:
        return None
    try:
        opts = json.loads(args.options)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--options is not JSON ({e}); e.g. --options '{{\"num_beams\": 4}}'")
    if not isinstance(opts, dict):
        raise SystemExit("--options must be a JSON object, e.g. '{\"num_beams\": 4}'")
    return opts


async def _submit(args: argparse.Namespace, texts: list[str], progress: bool) -> int:
    from tqdm import tqdm

    from worker.client import NllbClient
    from worker.messages import dump_reply

    settings = Settings()
    opts = _options(args)
    errors = 0
    async with NllbClient(settings.amqp_url.get_secret_value(), settings.jobs_queue,
                          name="nllb-submit") as client:
        bar = tqdm(total=len(texts), disable=not progress, file=sys.stderr, unit="job")
        sem = asyncio.Semaphore(args.concurrency)

        async def one(i: int, text: str) -> Any:
            async with sem:
                r = await client.translate([text], args.src, args.tgt, adapter=args.adapter,
                                           options=opts, job_id=f"submit-{os.getpid()}-{i}",
                                           timeout=args.timeout)
                bar.update(1)
                return r

        tasks = [asyncio.create_task(one(i, t)) for i, t in enumerate(texts)]
        for t in tasks:  # in input order, as they complete
            reply = await t
            errors += reply.status != "ok"
            sys.stdout.write(dump_reply(reply).decode() + "\n")
            sys.stdout.flush()
        bar.close()
    return 1 if errors else 0


def cmd_submit(args: argparse.Namespace) -> int:
    texts, from_file = _read_texts(args)
    return asyncio.run(_submit(args, texts, from_file))


# --- translate (local, no broker) ---------------------------------------------------------------

def cmd_translate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine import GenerationOptions
    from worker.logs import configure

    settings = Settings()
    configure("console" if sys.stderr.isatty() else "json", "warning")
    texts, from_file = _read_texts(args)
    opts = _options(args)
    model = Path(args.model) if args.model else None
    if args.device:
        settings = settings.model_copy(update={"device": args.device})
    engine = load_engine(settings, model)
    try:
        gen = GenerationOptions(**opts) if opts else None
        bar = tqdm(total=len(texts), disable=not from_file, file=sys.stderr, unit="seg")
        for start in range(0, len(texts), args.batch):
            chunk = texts[start:start + args.batch]
            for src, t in zip(chunk, engine.translate(chunk, args.src, args.tgt, options=gen,
                                                      adapter=args.adapter)):
                if args.json:
                    print(json.dumps({"source": src, "text": t.text, "tokens": list(t.tokens),
                                      "score": float(t.score)}, ensure_ascii=False))
                else:
                    print(t.text)
            bar.update(len(chunk))
        bar.close()
    finally:
        engine.close()
    return 0


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
]


async def _demo_jobs(settings: Settings, queue: str) -> int:
    from worker.client import NllbClient
    async with NllbClient(settings.amqp_url.get_secret_value(), queue, name="nllb-demo") as c:
        for i, (title, body) in enumerate(DEMO_JOBS):
            body = {"v": 1, "id": f"demo-{i + 1}", **body}
            print(f"\n>>> {title}\n    job:   {json.dumps(body, ensure_ascii=False)}")
            fut = await c.publish(body)
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

def _job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("texts", nargs="*", help="texts to translate (or --file, or stdin)")
    p.add_argument("--file", help="one segment per line ('-' = stdin); shows a progress bar")
    p.add_argument("--src", default=None, help="source language, e.g. eng_Latn")
    p.add_argument("--tgt", default=None, help="target language, e.g. fra_Latn")
    p.add_argument("--adapter", default=None, help="LoRA adapter name")
    p.add_argument("--options", default=None, help='generation options as JSON, e.g. \'{"num_beams": 4}\'')


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nllb-worker", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="run the worker (settings from NLLB_* env / .env)")
    p.add_argument("--name", default="nllb-worker", help="AMQP connection name")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("submit", help="publish jobs to the broker; replies as JSON lines")
    _job_args(p)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait per job")
    p.add_argument("--concurrency", type=int, default=64, help="jobs in flight at once")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("translate", help="translate locally, no broker (Engine.translate)")
    _job_args(p)
    p.add_argument("--model", default=None, help="model directory (default NLLB_MODEL, else toy)")
    p.add_argument("--device", default=None, choices=["auto", "cuda", "cpu"])
    p.add_argument("--batch", type=int, default=32, help="segments per engine call")
    p.add_argument("--json", action="store_true", help="JSON lines with tokens and scores")
    p.set_defaults(func=cmd_translate)

    p = sub.add_parser("convert", help="convert DIR/pytorch_model.bin to safetensors, once")
    p.add_argument("dir")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("demo", help="fresh-machine demo: broker, toy worker, sample jobs")
    p.add_argument("--queue", default="nllb.demo.jobs")
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--worker-log", default=str(Path(tempfile.gettempdir()) / "nllb-demo-worker.log"))
    p.add_argument("--configured-model", dest="toy", action="store_false",
                   help="use NLLB_MODEL instead of the toy model")
    p.set_defaults(func=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("src", "tgt"):  # defaults from settings for submit/translate
        if hasattr(args, name) and getattr(args, name) is None:
            s = Settings()
            setattr(args, name, getattr(s, f"default_{name}_lang"))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
