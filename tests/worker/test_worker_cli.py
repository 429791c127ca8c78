"""The `nllb-worker` command: translate (local), submit (through the broker), demo, and the user's
mistakes (one line on stderr, exit status 2, never a traceback)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aio_pika
import pytest
from conftest import AMQP_URL, ROOT, worker_env

from engine.engine import default_row_cap
from helpers import PlainProducer, job
from worker.__main__ import build_parser, main
from worker.settings import Settings

pytestmark = pytest.mark.timeout(180)

TOY_ADAPTERS = str(ROOT / "engine" / "assets" / "adapters")
TOY_MODEL = str(ROOT / "engine" / "assets" / "toy")


def cli(args, names, input=None, timeout=150, **env):
    return subprocess.run([sys.executable, "-m", "worker", *args], cwd=ROOT, env=worker_env(names, **env),
                          input=input, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def nonames():
    return {"jobs_queue": "unused", "dead_letter_queue": "unused", "dead_letter_exchange": "unused"}


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """main() in this process, with no NLLB_* variables and no .env file around."""
    for k in [k for k in __import__("os").environ if k.startswith("NLLB_")]:
        monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_translate_local_args_stdin_file(nonames, engine, tmp_path):
    r = cli(["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--json", "hello world", "the cat"], nonames)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    want = engine.translate(["hello world", "the cat"], "eng_Latn", "fra_Latn")
    assert [x["tokens"] for x in lines] == [list(w.tokens) for w in want]
    r = cli(["translate", "--src", "eng_Latn", "--tgt", "fra_Latn"], nonames, input="hello world\n")
    assert r.returncode == 0 and r.stdout.splitlines() == [want[0].text]
    f = tmp_path / "in.txt"
    f.write_text("hello world\nthe cat\n")
    r = cli(["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--file", str(f)], nonames)
    assert r.returncode == 0 and r.stdout.splitlines() == [w.text for w in want]


def test_translate_blank_lines_come_back_empty_in_place(clean_env, engine, capsys):
    f = clean_env / "in.txt"
    f.write_text("hello world\n\n   \t\nthe cat\n\n")
    want = engine.translate(["hello world", "the cat"], "eng_Latn", "fra_Latn")
    assert main(["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--device", "cpu", "--batch", "2",
                 "--file", str(f)]) == 0
    assert capsys.readouterr().out.split("\n") == [want[0].text, "", "", want[1].text, "", ""]
    assert main(["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--device", "cpu", "--json",
                 "--file", str(f)]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["source"], x["text"]) for x in lines] == [
        ("hello world", want[0].text), ("", ""), ("   \t", ""), ("the cat", want[1].text), ("", "")]


@pytest.mark.parametrize("args, says", [
    (["translate", "hello"], "--src is required"),
    (["translate", "--src", "eng_Latn", "hello"], "--tgt is required"),
    (["translate", "--src", "eng_Latn", "--tgt", "fra_latn", "hello"], "did you mean 'fra_Latn'"),
    (["submit", "--src", "eng_Lat", "--tgt", "fra_Latn", "hello"], "did you mean 'eng_Latn'"),
    (["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--options", "{num_beams: 4}", "hello"],
     "--options is not JSON"),
    (["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--options", "[4]", "hello"], "JSON object"),
    (["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--options", '{"num_beam": 4}', "hello"],
     "unknown option 'num_beam'; did you mean 'num_beams'?"),
    (["submit", "--src", "eng_Latn", "--tgt", "fra_Latn", "--options", '{"top_kk": 4}', "hello"],
     "unknown option 'top_kk'; did you mean 'top_k'?"),
    (["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--options", '{"num_beams": 0}', "hello"],
     "num_beams=0 is out of range"),
    (["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--file", "missing.txt"],
     "--file missing.txt: No such file or directory"),
    (["submit", "--src", "eng_Latn", "--tgt", "fra_Latn", "--file", "missing.txt"],
     "--file missing.txt: No such file or directory"),
    (["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--batch", "0", "hello"],
     "--batch: 0 is not a positive integer"),
    (["submit", "--src", "eng_Latn", "--tgt", "fra_Latn", "--concurrency", "0", "hello"],
     "--concurrency: 0 is not a positive integer"),
    (["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--device", "cuda", "hello"],
     "torch sees no CUDA device"),
    (["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--model", TOY_MODEL, "--adapter", "fra-reverse",
      "hello"],
     "needs an adapters directory"),
    (["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--adapters-dir", TOY_ADAPTERS,
      "--adapter", "fra-reverse\n", "hello"], "is not a folder name"),
    (["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--model", ".", "hello"], "config.json is missing"),
    (["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--document", "missing.txt"],
     "--document missing.txt: No such file or directory"),
    (["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--document", "missing.txt", "hello"],
     "give --document alone"),
    (["submit", "--src", "eng_Latn", "--tgt", "fra_Latn", "--document", "missing.txt"],
     "--document missing.txt: No such file or directory"),
    (["submit", "--src", "eng_Latn", "--tgt", "fra_Latn", "--document", "-", "hello"], "give --document alone"),
    (["translate", "--src", "auto", "--tgt", "fra_Latn", "--device", "cpu", "qwzx vbnm"],
     "could not be identified with confidence (best guesses:"),
    (["cancel", "job-1", "--url", "amqp://guest:guest@127.0.0.1:1/"], "cannot reach the broker at"),
])
def test_user_mistake_is_one_line_and_exit_2(clean_env, capsys, args, says):
    try:
        rc = main(args)
    except SystemExit as e:  # argparse's own checks
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and says in err, err


def test_bad_setting_is_one_line_and_exit_2_in_a_real_process(nonames):
    r = cli(["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "hello"], nonames, NLLB_DEVICE="gpu")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "nllb-worker translate: error: NLLB_DEVICE: Input should be 'auto', 'cuda' or 'cpu' (got 'gpu')"]


def test_every_option_says_what_it_does_and_its_default():
    subcommands = build_parser()._subparsers._group_actions[0].choices
    assert set(subcommands) >= {"run", "submit", "translate", "convert", "demo"}
    for name, parser in subcommands.items():
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and "default" in action.help, (name, action.option_strings)
    submit = {o for a in subcommands["submit"]._actions for o in a.option_strings}
    assert {"--queue", "--url", "--timeout"} <= submit


def test_run_help_lists_every_setting():
    r = subprocess.run([sys.executable, "-m", "worker", "run", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, check=True)
    for name, field in Settings.model_fields.items():
        assert f"NLLB_{name.upper()} (default: " in r.stdout
        assert " ".join(field.description.split()[:4]) in " ".join(r.stdout.split())
    assert "guest:***@" in r.stdout and "guest:guest" not in r.stdout


@pytest.mark.rabbitmq
def test_submit_through_a_worker(names, spawn, tmp_path):
    w = spawn("w", NLLB_DEVICE="auto")
    w.wait_ready()
    f = tmp_path / "in.txt"
    f.write_text("hello world\n\nthe cat sat\n  \ngood morning\n")
    r = cli(["submit", "--src", "eng_Latn", "--tgt", "deu_Latn", "--options", '{"num_beams": 2}',
             "--file", str(f)], names)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[1] == lines[3] == lines[5] == "" and len(lines) == 6
    replies = [json.loads(lines[i]) for i in (0, 2, 4)]
    assert all(x["status"] == "ok" for x in replies)
    r = cli(["submit", "--src", "eng_Latn", "--tgt", "deu_Latn", "--adapter", "nope", "hello"], names)
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "unknown_adapter"
    # the startup log names the device the engine chose, not the setting's "auto"
    loaded = [x for x in w.log_lines() if x.get("event") == "engine loaded"]
    assert [(x["device"], x["device_setting"]) for x in loaded] == [("cpu", "auto")]
    # NLLB_MAX_ROWS_PER_JOB unset: the engine's own cap
    assert [x["max_rows_per_job"] for x in loaded] == [default_row_cap(loaded[0]["rows_total"])]
    assert w.terminate() == 0


@pytest.mark.rabbitmq
def test_output_warnings_and_row_cap_settings_reach_the_engine(names, spawn, engine):
    from engine import GenerationOptions
    w = spawn("w", NLLB_OUTPUT_WARNINGS="false", NLLB_MAX_ROWS_PER_JOB="3")
    w.wait_ready()
    loaded, = [x for x in w.log_lines() if x.get("event") == "engine loaded"]
    assert (loaded["max_rows_per_job"], loaded["output_warnings"]) == (3, False)
    text = "ta deshacho lidor tu nizela"
    # the oracle: an engine with warnings on flags this output
    oracle, = engine.translate([text], "eng_Latn", "fra_Latn", GenerationOptions(max_new_tokens=2))
    assert "truncated" in oracle.warnings

    async def body() -> tuple[dict, dict]:
        async with PlainProducer(AMQP_URL, names["jobs_queue"], names["reply_queue"]) as p:
            flagged = await p.one(job(text, options={"max_new_tokens": 2}), timeout=60)
            retry = await p.one(job(text, options={"on_warning": "retry"}), timeout=60)
        return flagged, retry
    flagged, retry = asyncio.run(asyncio.wait_for(body(), 120))
    assert flagged["status"] == "ok" and "warnings" not in flagged["translations"][0]
    assert retry["status"] == "error" and retry["error"]["code"] == "invalid_request"
    assert "output warnings are off" in retry["error"]["message"]
    assert w.terminate() == 0


@pytest.mark.rabbitmq
def test_submit_without_queue_says_so_in_one_line(names):
    r = cli(["submit", "--src", "eng_Latn", "--tgt", "fra_Latn", "--queue", names["jobs_queue"], "hello"], names)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"nllb-worker submit: error: queue '{names['jobs_queue']}' does not exist: start a worker with "
        "`nllb-worker run`"]
    r = cli(["submit", "--src", "eng_Latn", "--tgt", "fra_Latn", "--url", "amqp://guest:guest@127.0.0.1:1/",
             "hello"], names)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "cannot reach the broker at amqp://guest:***@127.0.0.1:1/" in r.stderr


@pytest.mark.rabbitmq
def test_submit_without_worker_times_out_each_job_as_a_failed_line(names):
    async def declare() -> None:
        c = await aio_pika.connect(AMQP_URL)
        await (await c.channel()).declare_queue(names["jobs_queue"], durable=True)
        await c.close()
    asyncio.run(declare())
    r = cli(["submit", "--src", "eng_Latn", "--tgt", "fra_Latn", "--timeout", "1", "--url", AMQP_URL,
             "--queue", names["jobs_queue"], "hello", " ", "world"], {**names, "jobs_queue": "unused"})
    assert r.returncode == 1
    assert f"no worker consumes '{names['jobs_queue']}' now" in r.stderr and "Traceback" not in r.stderr
    lines = r.stdout.split("\n")
    assert lines[1] == lines[3] == "" and len(lines) == 4
    for i in (0, 2):
        reply = json.loads(lines[i])
        assert reply["status"] == "error" and reply["error"]["code"] == "timeout"
        assert reply["id"].endswith(f"-{i}")


@pytest.mark.rabbitmq
@pytest.mark.slow
def test_demo(nonames, tmp_path, broker, engine):
    from worker.__main__ import DEMO_DOCUMENT
    r = subprocess.run([sys.executable, "-m", "worker", "demo", "--queue", f"nllb.test.demo.{tmp_path.name}",
                        "--worker-log", str(tmp_path / "demo.log")], cwd=ROOT,
                       env=worker_env(nonames), capture_output=True, text=True, timeout=170, check=False)
    assert r.returncode == 0, r.stdout + r.stderr + (tmp_path / "demo.log").read_text()[-2000:]
    replies = [json.loads(line.split("reply: ", 1)[1]) for line in r.stdout.splitlines() if "reply: " in line]
    assert [x["status"] for x in replies] == ["ok", "ok", "ok", "ok", "error", "error", "ok", "ok"]
    texts = [[t["text"] for t in x["translations"]] for x in replies[:4]]
    # the toy task: fra copies, deu reverses, spa keeps the first half; the adapter makes fra reverse
    assert texts == [["ta deshacho lidor tu nizela", "kadera"], ["elaz ni tudor lichosha de ta"],
                     ["ta deshacho li"], ["elaz ni tudor lichosha de ta"]]
    assert replies[3]["adapter"] == "fra-reverse"
    assert [x["error"]["code"] for x in replies[4:6]] == ["unknown_language", "invalid_request"]
    assert replies[6]["document"] == engine.submit_document(DEMO_DOCUMENT, "eng_Latn", "deu_Latn").result().text
    assert replies[7]["translations"][0]["detected_lang"] == "eng_Latn"
    assert "exit code 0" in r.stderr
    for queue in (f"nllb.test.demo.{tmp_path.name}", f"nllb.test.demo.{tmp_path.name}.dead"):
        subprocess.run(["rabbitmqctl", "delete_queue", queue], capture_output=True, check=False)


def test_adapter_name_must_be_a_folder_name_to_its_end():
    from engine import TOY_ADAPTERS_DIR, Engine
    from engine.errors import UnknownAdapter
    eng = Engine.load(device="cpu", max_rows=8, adapters_dir=TOY_ADAPTERS_DIR)
    try:
        for name in ("fra-reverse\n", "fra-reverse\nx", "../adapters/fra-reverse"):
            with pytest.raises(UnknownAdapter, match="not a folder name"):
                eng.translate(["ta deshacho"], "eng_Latn", "fra_Latn", adapter=name)
        assert eng.translate(["ta deshacho lidor tu nizela"], "eng_Latn", "fra_Latn",
                             adapter="fra-reverse")[0].text == "elaz ni tudor lichosha de ta"
    finally:
        eng.close()


# --- documents, language detection, warnings, cancellation --------------------------------------

DOCUMENT = ("Dear team,\r\n\r\n  ta deshacho lidor tu nizela. kadera lidor.  \r\n\n"
            "   - tu nizela\n\t- kadera\n\u3000ta deshacho\n\n")


def test_translate_document_keeps_the_layout(clean_env, engine, capsys, monkeypatch):
    import io
    path = clean_env / "doc.txt"
    path.write_bytes(DOCUMENT.encode())
    want = engine.submit_document(DOCUMENT, "eng_Latn", "deu_Latn").result()
    assert main(["translate", "--src", "eng_Latn", "--tgt", "deu_Latn", "--device", "cpu", "--document",
                 str(path)]) == 0
    out = capsys.readouterr().out
    assert out == want.text
    # the whitespace skeleton: same lines, line endings, indentation, blank lines
    src_lines, out_lines = DOCUMENT.splitlines(keepends=True), out.splitlines(keepends=True)
    assert len(out_lines) == len(src_lines)
    for s, o in zip(src_lines, out_lines):
        assert (s[:len(s) - len(s.lstrip())], s[len(s.rstrip()):]) == (o[:len(o) - len(o.lstrip())],
                                                                       o[len(o.rstrip()):])
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(DOCUMENT.encode())))
    assert main(["translate", "--src", "eng_Latn", "--tgt", "deu_Latn", "--device", "cpu", "--json",
                 "--document", "-"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply["document"] == want.text
    assert [(s["source"], s["text"]) for s in reply["segments"]] == [
        (s.source, s.translation.text) for s in want.segments]
    assert reply["usage"]["segments"] == len(want.segments) >= 5


def test_translate_src_auto_and_warnings(clean_env, engine, capsys):
    from engine import GenerationOptions
    texts = ["The weather is nice today and I am going to the park with my friends.",
             "Das Wetter ist heute schön und ich gehe mit meinen Freunden in den Park."]
    assert main(["translate", "--src", "auto", "--tgt", "fra_Latn", "--device", "cpu", "--json", *texts]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["detected_lang"] for x in lines] == ["eng_Latn", "deu_Latn"]
    assert all(0.5 < x["detected_confidence"] <= 1 for x in lines)
    sources = ["ta deshacho lidor tu nizela", "ta"]
    assert main(["translate", "--src", "eng_Latn", "--tgt", "fra_Latn", "--device", "cpu", "--json",
                 "--options", '{"max_new_tokens": 2}', *sources]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(x) for x in captured.out.splitlines()]
    want = engine.translate(sources, "eng_Latn", "fra_Latn", GenerationOptions(max_new_tokens=2))
    assert [x.get("warnings", []) for x in lines] == [w.warnings for w in want]
    assert "truncated" in want[0].warnings
    assert captured.err.splitlines() == [f'warning: line {i} "{text}": {", ".join(w.warnings)}'
                                         for i, (text, w) in enumerate(zip(sources, want), 1) if w.warnings]


@pytest.mark.rabbitmq
def test_cancel_command_publishes_to_the_control_exchange(names):
    exchange = names["jobs_queue"] + ".control"

    async def listen() -> aio_pika.abc.AbstractQueue:
        c = await aio_pika.connect(AMQP_URL)
        ch = await c.channel()
        ex = await ch.declare_exchange(exchange, aio_pika.ExchangeType.FANOUT, auto_delete=True)
        q = await ch.declare_queue(names["reply_queue"], auto_delete=False)
        await q.bind(ex)
        await c.close()
    asyncio.run(listen())
    r = cli(["cancel", "job-7", "--exchange", exchange], names)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == f"cancel sent for job 'job-7' to '{exchange}'"

    async def received() -> list[dict]:
        c = await aio_pika.connect(AMQP_URL)
        ch = await c.channel()
        q = await ch.declare_queue(names["reply_queue"], passive=True)
        out = []
        while (m := await q.get(fail=False)) is not None:
            out.append((m.content_type, json.loads(m.body)))
            await m.ack()
        await ch.exchange_delete(exchange)
        await c.close()
        return out
    assert asyncio.run(received()) == [("application/json", {"v": 1, "cancel": "job-7"})]
    r = cli(["cancel", "job-7", "--exchange", exchange], names)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"nllb-worker cancel: error: exchange '{exchange}' does not exist: start a worker with `nllb-worker run`"]


@pytest.mark.rabbitmq
@pytest.mark.parametrize("callback", [True, False], ids=["on_progress", "no_callback"])
def test_client_hands_partial_messages_to_on_progress_and_waits_for_the_final_reply(names, callback):
    """The test plays the worker: two partial messages, then the final reply, to the job's reply_to.
    Without a callback the partials are dropped: the future still resolves to the final reply only."""
    from worker.client import NllbClient
    from worker.messages import OkReply

    final = {"v": 1, "id": "d1", "status": "ok", "translations": [{"text": "a"}], "src_lang": "eng_Latn",
             "tgt_lang": "fra_Latn", "model": "toy", "usage": {"src_tokens": 3, "tgt_tokens": 2},
             "timings_ms": {"queued": 1.0, "compute": 2.0}}
    partials = [{"v": 1, "id": "d1", "status": "partial", "done": 1, "total": 3,
                 "segments": [{"index": 0, "text": "x"}]},
                {"v": 1, "id": "d1", "status": "partial", "done": 3, "total": 3,
                 "segments": [{"index": 1, "text": "y"}, {"index": 2, "text": "z"}]}]

    async def body() -> None:
        c = await aio_pika.connect(AMQP_URL)
        ch = await c.channel()
        jobs = await ch.declare_queue(names["jobs_queue"], durable=True)
        seen: list[dict] = []
        async with NllbClient(AMQP_URL, names["jobs_queue"]) as client:
            fut = await client.publish({"v": 1, "id": "d1", "text": "abc", "options": {"progress": True}},
                                       on_progress=seen.append if callback else None)
            job = await jobs.get(timeout=10)
            for message in [*partials, final]:
                await ch.default_exchange.publish(aio_pika.Message(json.dumps(message).encode(),
                                                                   correlation_id=job.correlation_id),
                                                  routing_key=job.reply_to)
            reply = await client.wait(fut, 10)
            await job.ack()
        await c.close()
        assert seen == (partials if callback else [])
        assert isinstance(reply, OkReply) and reply.translations[0].text == "a"
        assert client.late == client.duplicates == 0
    asyncio.run(asyncio.wait_for(body(), 60))


def test_cpu_threads_default_to_one_for_a_small_model_on_the_cpu_and_torchs_default_else(clean_env, tmp_path,
                                                                                          monkeypatch):
    import dataclasses
    import torch
    from engine.config import load_config
    from engine.devices import cpu_threads_for
    from worker.cli import cpu_threads
    toy = load_config(ROOT / "engine" / "assets" / "toy")
    assert cpu_threads_for(toy) == 1
    assert cpu_threads_for(dataclasses.replace(toy, d_model=1024, encoder_ffn_dim=4096, decoder_ffn_dim=4096,
                                               vocab_size=256206)) is None  # the 600M shape
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cpu_threads(Settings()) == 1  # the toy model, device auto on a machine without a GPU
    assert cpu_threads(Settings(cpu_threads=3)) == 3
    assert cpu_threads(Settings(model=tmp_path)) is None  # no config.json: load_engine says what is wrong
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_threads(Settings()) is None  # the engine will run on the GPU
    assert cpu_threads(Settings(device="cpu")) == 1
