"""`nllb-worker run` with settings it cannot use: one line on stderr and exit status 2 before anything starts, never
a traceback nor a password; settings it does not know: one warning naming them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def run_worker(cwd: Path, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m worker run` in `cwd` (its .env file) with only the NLLB_* variables given."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NLLB_")}
    environ.update(PYTHONUNBUFFERED="1", NLLB_DEVICE="cpu", NLLB_METRICS_PORT="0", NLLB_LOG_FORMAT="json")
    environ.update(env)
    return subprocess.run([sys.executable, "-m", "worker", "run"], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.mark.parametrize("url, says", [
    ("amqp://guest:s3cret@127.0.0.1:99999/", "NLLB_AMQP_URL: the port is not a number in 1-65535 "
                                             "(got 'amqp://guest:***@127.0.0.1:99999/')"),
    ("http://guest:s3cret@127.0.0.1:5672/", "NLLB_AMQP_URL: not an AMQP URL"),
    ("amqp://guest:s3c/ret@127.0.0.1/", "(got 'amqp://***@127.0.0.1/')"),  # a / the parser takes for the path's
])
def test_an_unusable_amqp_url_is_one_line_and_exit_2_without_its_password(tmp_path, url, says):
    r = run_worker(tmp_path, NLLB_AMQP_URL=url)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert len(r.stderr.splitlines()) == 1 and says in r.stderr and "s3c" not in r.stderr
    submit = subprocess.run([sys.executable, "-m", "worker", "submit", "--url", url, "--src", "eng_Latn", "--tgt",
                             "fra_Latn", "hello"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            check=False)
    assert submit.returncode == 2 and len(submit.stderr.splitlines()) == 1 and "s3c" not in submit.stderr, \
        submit.stderr


def test_a_dotenv_file_that_is_not_utf8_is_one_line_and_exit_2(tmp_path):
    (tmp_path / ".env").write_bytes("NLLB_JOBS_QUEUE=caf\u00e9\n".encode("latin-1"))
    r = run_worker(tmp_path)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "nllb-worker run: error: .env: not UTF-8 (invalid continuation byte at byte 19); save it as UTF-8"]


def test_a_check_across_settings_is_one_line_naming_them_without_the_password(tmp_path):
    r = run_worker(tmp_path, timeout=30, NLLB_METRICS_PORT="65534", NLLB_BROKER_PROCESSES="3",
                   NLLB_AMQP_URL="amqp://guest:s3cret@127.0.0.1:1/")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "nllb-worker run: error: NLLB_METRICS_PORT: broker process 2 would serve on NLLB_METRICS_PORT + 2 = 65536, "
        "beyond port 65535"]


def test_run_warns_once_of_unknown_settings_with_the_closest_known_one(tmp_path):
    (tmp_path / ".env").write_text("NLLB_JOB_QUEUE=typo.jobs\nNLLB_DELIVERY_LIMIT=3\n")
    # a model directory that is not there: the worker stops (2) right after its start-up lines
    r = run_worker(tmp_path, NLLB_MODEL=str(tmp_path / "missing"), NLLB_MAX_SEGMENT="5", NLLB_FLAVOUR="x")
    assert r.returncode == 2, r.stderr
    warnings = [x for x in map(json.loads, r.stdout.splitlines()) if x["event"] == "unknown settings ignored"]
    assert [x["unknown"] for x in warnings] == [[
        "NLLB_MAX_SEGMENT (environment): did you mean NLLB_MAX_SEGMENTS?", "NLLB_FLAVOUR (environment)",
        "NLLB_JOB_QUEUE (.env): did you mean NLLB_JOBS_QUEUE?"]]
