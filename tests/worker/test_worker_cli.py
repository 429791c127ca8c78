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
def test_demo(nonames, tmp_path, broker):
    r = subprocess.run([sys.executable, "-m", "worker", "demo", "--queue", f"nllb.test.demo.{tmp_path.name}",
                        "--worker-log", str(tmp_path / "demo.log")], cwd=ROOT,
                       env=worker_env(nonames), capture_output=True, text=True, timeout=170, check=False)
    assert r.returncode == 0, r.stdout + r.stderr + (tmp_path / "demo.log").read_text()[-2000:]
    replies = [json.loads(line.split("reply: ", 1)[1]) for line in r.stdout.splitlines() if "reply: " in line]
    assert [x["status"] for x in replies] == ["ok", "ok", "ok", "ok", "error", "error"]
    texts = [[t["text"] for t in x["translations"]] for x in replies[:4]]
    # the toy task: fra copies, deu reverses, spa keeps the first half; the adapter makes fra reverse
    assert texts == [["ta deshacho lidor tu nizela", "kadera"], ["elaz ni tudor lichosha de ta"],
                     ["ta deshacho li"], ["elaz ni tudor lichosha de ta"]]
    assert replies[3]["adapter"] == "fra-reverse"
    assert [x["error"]["code"] for x in replies[4:]] == ["unknown_language", "invalid_request"]
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
