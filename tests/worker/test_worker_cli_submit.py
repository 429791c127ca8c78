"""`nllb-worker submit` against an in-process worker (real broker, toy engine): a document's layout
round trip, its progress bar driven by partial messages, Ctrl-C cancelling the job on the worker,
and warnings and detected languages on stderr; against a scripted worker and a broker cut off by a proxy, the
failures printed as error lines; and `cancel`'s exchange from the settings. The command runs as a subprocess, the
way a user runs it; the oracles are the engine's own translations and the worker's metrics."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import sys

import aio_pika
import pytest
from conftest import AMQP_URL, ROOT, run, worker_env
from helpers import eventually, in_process_worker

from engine import Engine, GenerationOptions
from engine.text.segment import split_document
from tests.worker.test_client_broker_down import BrokerProxy, declare_jobs_queue
from tests.worker.test_client_replies import ScriptedWorker, ok
from tests.worker.test_worker_cancel import SLOW, long_document
from tests.worker.test_worker_cli import DOCUMENT, cli

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(180)]


JOB_IDS_NOTE = re.compile(r"^nllb-worker submit: job ids (submit-[0-9a-f]{12})-<index>, the input line's index "
                          r"from 0 \(`nllb-worker cancel ID` cancels one\)$", re.M)


async def start_submit(names: dict, *args: str, stdin: bytes | None = None, url: str = AMQP_URL,
                       **env: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker", "submit", "--url", url, "--queue", names["jobs_queue"], *args,
        cwd=ROOT, env=worker_env(names, **env), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    if stdin is not None:
        proc.stdin.write(stdin)
    proc.stdin.close()
    return proc


async def submit(names: dict, *args: str, stdin: bytes | None = None, timeout: float = 120) -> tuple[int, bytes, str]:
    proc = await start_submit(names, *args, stdin=stdin)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode, out, err.decode()


def test_submit_document_keeps_the_layout_and_names_warnings(settings, names, engine, tmp_path):
    path = tmp_path / "doc.txt"
    path.write_bytes(DOCUMENT.encode())
    want = engine.submit_document(DOCUMENT, "eng_Latn", "deu_Latn").result()
    short = GenerationOptions(max_new_tokens=2)
    want_short = engine.submit_document(DOCUMENT, "eng_Latn", "deu_Latn", options=short).result()
    assert any(s.translation.warnings for s in want_short.segments)  # the oracle flags truncated sentences

    async def body():
        async with in_process_worker(settings, engine) as svc:
            rc, out, err = await submit(names, "--src", "eng_Latn", "--tgt", "deu_Latn", "--document", str(path))
            assert rc == 0, err
            assert out == want.text.encode()  # byte for byte: CRLF, blank lines, indentation
            n = len(want.segments)
            assert re.search(rf"segments: 100%.*\b{n}/{n}\b", err), err
            assert "warning" not in err
            rc, out, err = await submit(names, "--src", "eng_Latn", "--tgt", "deu_Latn", "--json", "--document",
                                        "-", "--options", '{"max_new_tokens": 2, "return_segments": true}',
                                        stdin=DOCUMENT.encode())
            assert rc == 0, err
            reply = json.loads(out)
            assert reply["document"] == want_short.text
            assert [(s["source"], s.get("warnings", [])) for s in reply["segments"]] == [
                (s.source, s.translation.warnings) for s in want_short.segments]
            flagged = [i for i, s in enumerate(want_short.segments, 1) if s.translation.warnings]
            assert [int(x) for x in re.findall(r"^warning: sentence (\d+) ", err, re.M)] == flagged
            assert svc.metrics.partials._value.get() >= 1  # progress was asked for and sent
    run(body(), 150)


def test_submit_texts_src_auto_and_warnings_on_stderr(settings, names, engine):
    english = "The weather is nice today and I am going to the park with my friends."
    text = "ta deshacho lidor tu nizela"
    oracle, = engine.translate([text], "eng_Latn", "fra_Latn", GenerationOptions(max_new_tokens=2))
    assert "truncated" in oracle.warnings

    async def body():
        async with in_process_worker(settings, engine):
            rc, out, err = await submit(names, "--src", "auto", "--tgt", "fra_Latn", english)
            assert rc == 0, err
            reply = json.loads(out)
            assert reply["translations"][0]["detected_lang"] == "eng_Latn"
            assert re.search(r"^detected: line 1 \"The weather.*\": eng_Latn \(confidence 0\.\d\d\)$", err, re.M), err
            rc, out, err = await submit(names, "--src", "eng_Latn", "--tgt", "fra_Latn", "--options",
                                        '{"max_new_tokens": 2}', text)
            assert rc == 0, err
            assert json.loads(out)["translations"][0]["warnings"] == oracle.warnings
            assert err.splitlines()[1:] == [f'warning: line 1 "{text}": {", ".join(oracle.warnings)}']
    run(body(), 120)


@pytest.mark.parametrize("exchange_from", ["environment", "flag"])
def test_ctrl_c_on_submit_document_cancels_the_job_on_the_worker(settings, names, toy_dir, exchange_from):
    eng = Engine.load(toy_dir, device="cpu", max_rows=8)
    document = long_document(3, 200)
    total = len(split_document(document, "eng_Latn").sentences)
    settings = settings.model_copy(update={"control_exchange": names["jobs_queue"] + ".control"})

    async def body():
        async with in_process_worker(settings, eng) as svc:
            exchange = ({"NLLB_CONTROL_EXCHANGE": settings.control_exchange} if exchange_from == "environment"
                        else {})
            flag = ["--exchange", settings.control_exchange] if exchange_from == "flag" else []
            proc = await start_submit(names, "--src", "eng_Latn", "--tgt", "fra_Latn", "--document", "-", *flag,
                                      "--options", json.dumps(SLOW), stdin=document.encode(), **exchange)
            err = b""
            # the bar shows the worker's progress: segments done out of the document's sentences
            while not re.search(rb"\| *[1-9]\d*/%d " % total, err):
                chunk = await asyncio.wait_for(proc.stderr.read(256), 60)
                assert chunk, err.decode()
                err += chunk
            assert eng.stats().rows_used > 0
            proc.send_signal(signal.SIGINT)
            out, rest = await asyncio.wait_for(proc.communicate(), 30)
            err = (err + rest).decode()
            assert proc.returncode == 130 and out == b""
            assert "Traceback" not in err and err.count("\n") == 2  # the bar leaves no line of its own
            job_id, = re.findall(r"^nllb-worker submit: job (submit-[0-9a-f]{12}-document) \(Ctrl-C or "
                                 r"`nllb-worker cancel \1` cancels it\)$", err, re.M)
            assert err.rsplit("\r", 1)[-1] == ("nllb-worker submit: interrupted; cancel sent for job "
                                               f"'{job_id}': the worker answered cancelled\n")
            await eventually(lambda: svc.metrics.cancellations.labels("running")._value.get() == 1, 5,
                             "the worker's cancellation")
            await eventually(lambda: eng.stats().cancelled_jobs == 1 and eng.stats().rows_used == 0, 5,
                             "the rows freed")
    try:
        run(body(), 150)
    finally:
        eng.close()


def test_submit_names_its_random_job_ids_on_stderr(names):
    async def body():
        async with ScriptedWorker(names["jobs_queue"], lambda job: [ok(job["id"])]):
            runs = [await submit(names, "--src", "eng_Latn", "--tgt", "fra_Latn", "hello", "world") for _ in range(2)]
        prefixes = []
        for rc, out, err in runs:
            assert rc == 0, err
            prefix, = JOB_IDS_NOTE.findall(err)
            assert [json.loads(line)["id"] for line in out.splitlines()] == [f"{prefix}-0", f"{prefix}-1"]
            prefixes.append(prefix)
        assert prefixes[0] != prefixes[1]
    run(body(), 60)


def test_submit_prints_a_malformed_reply_as_an_error_line_and_goes_on(names):
    def script(job: dict) -> list[bytes]:
        return [b"[1, 2]" if job["texts"] == ["bad"] else ok(job["id"])]

    async def body():
        async with ScriptedWorker(names["jobs_queue"], script):
            rc, out, err = await submit(names, "--src", "eng_Latn", "--tgt", "fra_Latn", "bad", "good")
        assert rc == 1 and "Traceback" not in err
        bad, good = [json.loads(line) for line in out.splitlines()]
        assert bad["error"]["code"] == "malformed_reply" and "b'[1, 2]'" in bad["error"]["message"]
        assert good["status"] == "ok"
    run(body(), 60)


def test_submit_prints_an_error_line_per_job_while_the_broker_is_unreachable(names):
    async def body():
        await declare_jobs_queue(names["jobs_queue"])
        async with BrokerProxy() as proxy:
            proc = await start_submit(names, "--src", "eng_Latn", "--tgt", "fra_Latn", "--timeout", "2",
                                      "--concurrency", "1", "a", "b", "c", url=proxy.url)
            err = b""
            while not JOB_IDS_NOTE.search(err.decode()):  # connected: the jobs go out now
                err += await asyncio.wait_for(proc.stderr.readline(), 30)
            proxy.mode = "refuse"
            proxy.cut()
            out, rest = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 1 and "Traceback" not in rest.decode()
        codes = [json.loads(line)["error"]["code"] for line in out.splitlines()]
        assert len(codes) == 3 and set(codes) <= {"timeout", "broker_unavailable"}  # the first may have gone out
        assert codes[1:] == ["broker_unavailable"] * 2
    run(body(), 60)


def test_cancel_sends_to_the_control_exchange_of_the_settings(names):
    exchange = names["jobs_queue"] + ".control"

    async def body() -> None:
        connection = await aio_pika.connect(AMQP_URL)
        channel = await connection.channel()
        cancels = await channel.declare_queue(exclusive=True)
        await cancels.bind(await channel.declare_exchange(exchange, aio_pika.ExchangeType.FANOUT, auto_delete=True))
        r = await asyncio.to_thread(cli, ["cancel", "job-7"], names, NLLB_CONTROL_EXCHANGE=exchange)
        assert r.returncode == 0 and r.stderr.strip() == f"cancel sent for job 'job-7' to '{exchange}'", r.stderr
        assert json.loads((await cancels.get(timeout=5)).body) == {"v": 1, "cancel": "job-7"}
        await connection.close()
    run(body(), 60)
