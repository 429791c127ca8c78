"""The `nllb-worker` command: translate (local), submit (through the broker), demo."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, worker_env

pytestmark = pytest.mark.timeout(180)


def cli(args, names, input=None, timeout=150, **env):
    return subprocess.run([sys.executable, "-m", "worker", *args], cwd=ROOT, env=worker_env(names, **env),
                          input=input, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def nonames():
    return {"jobs_queue": "unused", "dead_letter_queue": "unused", "dead_letter_exchange": "unused"}


def test_translate_local_args_stdin_file(nonames, engine, tmp_path):
    from engine.options import GenerationOptions  # noqa: F401
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


@pytest.mark.rabbitmq
def test_submit_through_a_worker(names, spawn, tmp_path):
    w = spawn("w")
    w.wait_ready()
    f = tmp_path / "in.txt"
    f.write_text("hello world\nthe cat sat\ngood morning\n")
    r = cli(["submit", "--src", "eng_Latn", "--tgt", "deu_Latn", "--options", '{"num_beams": 2}',
             "--file", str(f)], names)
    assert r.returncode == 0, r.stderr
    replies = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(replies) == 3 and all(x["status"] == "ok" for x in replies)
    r = cli(["submit", "--src", "eng_Latn", "--tgt", "xx_Latn", "hello"], names)
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "unknown_language"
    assert w.terminate() == 0


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
