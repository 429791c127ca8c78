"""`nllb-worker submit` against an in-process worker (real broker, toy engine): a document's layout
round trip, its progress bar driven by partial messages, Ctrl-C cancelling the job on the worker,
and warnings and detected languages on stderr. The command runs as a subprocess, the way a user runs
it; the oracles are the engine's own translations and the worker's metrics."""
from __future__ import annotations

import asyncio
import json
import re
import signal
import sys

import pytest
from conftest import AMQP_URL, ROOT, run, worker_env
from helpers import eventually, in_process_worker

from engine import Engine, GenerationOptions
from engine.text.segment import split_document
from tests.worker.test_worker_cancel import SLOW, long_document
from tests.worker.test_worker_cli import DOCUMENT

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(180)]


async def start_submit(names: dict, *args: str, stdin: bytes | None = None) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker", "submit", "--url", AMQP_URL, "--queue", names["jobs_queue"], *args,
        cwd=ROOT, env=worker_env(names), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    if stdin is not None:
        proc.stdin.write(stdin)
    proc.stdin.close()
    return proc


async def submit(names: dict, *args: str, stdin: bytes | None = None) -> tuple[int, bytes, str]:
    proc = await start_submit(names, *args, stdin=stdin)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
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
            assert err.splitlines() == [f'warning: line 1 "{text}": {", ".join(oracle.warnings)}']
    run(body(), 120)


def test_ctrl_c_on_submit_document_cancels_the_job_on_the_worker(settings, names, toy_dir):
    eng = Engine.load(toy_dir, device="cpu", max_rows=8)
    document = long_document(3, 200)
    total = len(split_document(document, "eng_Latn").sentences)

    async def body():
        async with in_process_worker(settings, eng) as svc:
            proc = await start_submit(names, "--src", "eng_Latn", "--tgt", "fra_Latn", "--document", "-",
                                      "--options", json.dumps(SLOW), stdin=document.encode())
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
            assert "Traceback" not in err and err.count("\n") == 1  # the bar leaves no line of its own
            assert err.rsplit("\r", 1)[-1] == ("nllb-worker submit: interrupted; cancel sent for job "
                                               f"'submit-{proc.pid}-document': the worker answered cancelled\n")
            await eventually(lambda: svc.metrics.cancellations.labels("running")._value.get() == 1, 5,
                             "the worker's cancellation")
            await eventually(lambda: eng.stats().cancelled_jobs == 1 and eng.stats().rows_used == 0, 5,
                             "the rows freed")
    try:
        run(body(), 150)
    finally:
        eng.close()
