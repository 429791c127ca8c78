"""Unit tests without a broker: settings, protocol models, the decision table, sd_notify, HTTP."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
from types import SimpleNamespace

import pytest

from worker.topology import describe_mismatch
from worker.health import Health, LoopMonitor, sd_notify, watchdog_interval_s
from engine import GenerationOptions
from worker.messages import WORKER_OPTIONS, BadJob, JobOptions, dump_reply, error_reply, parse_job, parse_reply
from worker.metrics import Metrics
from worker.outcomes import ACTIONS, Outcome, decide
from worker.settings import Settings

pytestmark = pytest.mark.timeout(30)


def test_settings_defaults_env_and_dotenv(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith("NLLB_"):
            monkeypatch.delenv(k)
    s = Settings(_env_file=None)
    assert (s.model, s.jobs_queue, s.dead_letter_exchange, s.dead_letter_queue) == (
        None, "nllb.jobs", "nllb.dlx", "nllb.jobs.dead")
    assert (s.delivery_limit, s.device, s.metrics_port, s.drain_timeout_s, s.prefetch) == (3, "auto", 9464, 60.0, None)
    env = tmp_path / ".env"
    env.write_text("NLLB_JOBS_QUEUE=from.dotenv\nNLLB_DELIVERY_LIMIT=5\nNLLB_AMQP_URL=amqp://u:s3cret@h:5672/v\n")
    monkeypatch.setenv("NLLB_DEVICE", "CPU")
    monkeypatch.setenv("NLLB_MAX_ROWS", "")
    s = Settings(_env_file=env)
    assert (s.jobs_queue, s.delivery_limit, s.device, s.max_rows) == ("from.dotenv", 5, "cpu", None)
    dumped = json.dumps(s.safe_dump())
    assert "s3cret" not in dumped and "s3cret" not in repr(s) and "u:***@h:5672" in dumped
    for name, field in Settings.model_fields.items():
        assert field.description, f"{name} needs a description (.env.example is made from them)"


def test_strict_job_parsing():
    ok = parse_job(b'{"v": 1, "id": "a", "texts": ["x", "y"], "src_lang": "eng_Latn", "options": {"num_beams": 2}}')
    assert ok.segments == ["x", "y"] and ok.options.generation_fields() == {"num_beams": 2}
    assert parse_job(b'{"v": 1, "text": "x", "options": {"return_tokens": true}}').options.generation_fields() == {}
    for bad in [b'{"v": 1, "text": "x", "extra": 1}', b'{"v": 1, "text": "x", "options": {"beams": 2}}',
                b'{"v": 1, "text": "x", "texts": ["y"]}', b'{"v": 1}', b'{"v": "1", "text": "x"}',
                b'{"v": 1, "text": "x", "options": {"do_sample": 1}}', b'{"v": 1, "text": "x", "deadline_ms": "soon"}',
                b"nope", b"null", b'{"v": 1, "text": "x", "deadline_ms": ' + b"9" * 5000 + b"}"]:
        with pytest.raises(BadJob):  # an integer past Python's 4,300 digits too: answered, not requeued
            parse_job(bad)
    with pytest.raises(BadJob) as e:
        parse_job(b'{"v": 1, "id": "keep", "text": "x", "bogus": 1}')
    assert e.value.job_id == "keep" and "bogus" in str(e.value)


def test_job_options_are_the_engine_options_plus_the_workers_own():
    """One schema: an option declared on engine.GenerationOptions is accepted in a job as is."""
    engine_fields = [f.name for f in dataclasses.fields(GenerationOptions)]
    assert list(JobOptions.model_fields) == engine_fields + list(WORKER_OPTIONS)
    every = {"num_beams": 4, "num_return_sequences": 2, "length_penalty": 0.5, "early_stopping": True,
             "do_sample": False, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3,
             "no_repeat_ngram_size": 2, "repetition_penalty": 1.1, "min_new_tokens": 1, "max_new_tokens": 9}
    assert set(every) == set(engine_fields)
    opts = JobOptions.model_validate({**every, "return_scores": True})
    assert GenerationOptions(**opts.generation_fields()) == GenerationOptions(**every)
    for bad, words in [({"do_sample": 1}, "options.do_sample: Input should be a valid boolean"),
                       ({"num_beams": "4"}, "options.num_beams: Input should be a valid integer"),
                       ({"num_beam": 4}, "unknown field 'options.num_beam'")]:
        with pytest.raises(BadJob, match=words):
            parse_job(json.dumps({"v": 1, "text": "x", "options": bad}).encode())


def test_reply_roundtrip_and_lenient_client_parsing():
    r = error_reply("j", "overloaded", "busy")
    assert r.error.retryable is True and error_reply("j", "too_long", "x").error.retryable is False
    back = parse_reply(dump_reply(r))
    assert back.error.code == "overloaded"
    # a future optional field does not break clients
    ok = parse_reply(json.dumps({"v": 1, "id": "j", "status": "ok", "translations": [{"text": "t", "new": 1}],
                                 "src_lang": "a", "tgt_lang": "b", "model": "m",
                                 "usage": {"src_tokens": 1, "tgt_tokens": 1},
                                 "timings_ms": {"queued": 0, "compute": 1}, "later_field": True}).encode())
    assert ok.translations[0].text == "t"


def test_decision_table_is_total_and_matches_protocol():
    assert set(ACTIONS) == set(Outcome)
    assert decide(Outcome.OK) == "ack" and decide(Outcome.ERROR) == "ack"
    assert decide(Outcome.DEAD_LETTER) == "reject"
    assert decide(Outcome.REQUEUE) == "retry"
    assert decide(Outcome.RELEASED) == "release"
    assert decide(Outcome.HANDED_BACK) == "republish"
    assert decide(Outcome.UNDELIVERABLE) == "reject"


@pytest.mark.parametrize("text, words", [
    ("PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue 'nllb.jobs' in vhost '/': received "
     "the value '5' of type 'signedint' but current is the value '3' of type 'long'",
     ["queue 'nllb.jobs'", "x-delivery-limit=3 but", "declares x-delivery-limit=5", "set NLLB_DELIVERY_LIMIT=3"]),
    ("PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-strategy' for queue 'q' in vhost '/': received "
     "the value 'at-least-once' of type 'longstr' but current is none",
     ["exists with x-dead-letter-strategy=unset", "declares x-dead-letter-strategy=at-least-once",
      "change this worker's settings", "rabbitmqctl delete_queue q"]),
    ("PRECONDITION_FAILED - something new", ["something new", "make the NLLB_* settings match"]),
])
def test_topology_mismatch_is_one_line_naming_both_values_and_the_fix(text, words):
    line = describe_mismatch(text)
    assert "\n" not in line and all(w in line for w in words), line


@pytest.mark.parametrize("abstract", [False, True])
def test_sd_notify_path_and_abstract_socket(tmp_path, monkeypatch, abstract):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"nllb-test-{os.getpid()}"
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    else:
        path = str(tmp_path / "notify")
        sock.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
    sock.settimeout(2)
    try:
        assert sd_notify("READY=1")
        assert sock.recv(100) == b"READY=1"
    finally:
        sock.close()
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert sd_notify("READY=1") is False


def test_watchdog_interval(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert watchdog_interval_s() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert watchdog_interval_s() is None


def test_http_endpoints_and_watchdog(monkeypatch, tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    sock.bind(path)
    sock.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # 0.1 s -> pet every 0.05 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    state = {"ready": False, "engine": True}

    async def get(port, path):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = await r.read()
        w.close()
        return int(data.split()[1]), data.split(b"\r\n\r\n", 1)[1]

    async def body():
        m = Metrics()
        mon = LoopMonitor(m)
        mon.start()
        h = Health(m, mon, lambda: state["ready"], lambda: state["engine"])
        await h.start_http("127.0.0.1", 0)
        h.start_watchdog()
        assert (await get(h.port, "/healthz"))[0] == 200
        assert (await get(h.port, "/readyz"))[0] == 503
        state["ready"] = True
        assert (await get(h.port, "/readyz"))[0] == 200
        code, text = await get(h.port, "/metrics")
        assert code == 200 and b"nllb_ready 1.0" in text
        assert (await get(h.port, "/nope"))[0] == 404
        await asyncio.sleep(0.3)
        pets = 0
        while True:
            try:
                pets += sock.recv(100) == b"WATCHDOG=1"
            except BlockingIOError:
                break
        assert pets >= 3
        state["engine"] = False  # an unhealthy engine: no more WATCHDOG=1
        await asyncio.sleep(0.1)
        while True:
            try:
                sock.recv(100)
            except BlockingIOError:
                break
        await asyncio.sleep(0.3)
        with pytest.raises(BlockingIOError):
            sock.recv(100)
        await h.stop()
        await mon.stop()
    asyncio.run(asyncio.wait_for(body(), 20))
    sock.close()


def test_engine_is_loaded_with_the_adapter_limits_and_warmed_up_unless_told_not_to(monkeypatch):
    """NLLB_MAX_ADAPTERS and NLLB_MAX_LORA_RANK reach Engine.load (the stacked decoder GEMMs widen with both); the
    loaded engine captures the common sentences' graphs (Engine.warm_up_sentences) unless NLLB_WARM_UP is off."""
    import engine
    from worker.cli import load_engine
    for k in list(os.environ):
        if k.startswith("NLLB_"):
            monkeypatch.delenv(k)
    seen: dict = {}

    warm_ups: list[int] = []

    class Loaded:
        model_name, rows_total, max_source_tokens = "toy", 1, 1
        backend = SimpleNamespace(device="cpu", dtype="torch.float32")
        scheduler = SimpleNamespace(row_cap=1)

        def warm_up_sentences(self) -> int:
            warm_ups.append(1)
            return 3

    monkeypatch.setattr(engine.Engine, "load", staticmethod(lambda **kwargs: seen.update(kwargs) or Loaded()))
    load_engine(Settings(_env_file=None, max_adapters=4, max_lora_rank=16))
    assert (seen["max_adapters"], seen["max_lora_rank"]) == (4, 16)
    seen.clear()
    load_engine(Settings(_env_file=None))
    assert "max_adapters" not in seen and "max_lora_rank" not in seen  # unset: the engine's defaults
    assert len(warm_ups) == 2
    load_engine(Settings(_env_file=None, warm_up=False))
    assert len(warm_ups) == 2


def test_detect_threshold_setting_reaches_the_engine():
    from engine.errors import UnknownLanguage
    from worker.cli import load_engine
    text = "Le comité se réunira mardi pour discuter du nouveau budget."  # French, at about 0.99
    eng = load_engine(Settings(_env_file=None, device="cpu", max_rows=4, detect_threshold=0.999))
    try:
        with pytest.raises(UnknownLanguage, match="best guesses: fra_Latn"):
            eng.submit([text], "auto", "deu_Latn")
    finally:
        eng.close()


def test_job_series_expose_what_prometheus_client_series_would():
    """Metrics' per-job series (plain numbers read at scrape time) against prometheus_client's own Counter and
    Histogram given the same updates: the same samples, less the histograms' _created."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from worker.metrics import _LAT

    oracle = CollectorRegistry()
    jobs = Counter("nllb_jobs", "", ["outcome", "code"], registry=oracle)
    compute = Histogram("nllb_job_compute_seconds", "", buckets=_LAT, registry=oracle)
    tokens = Counter("nllb_generated_tokens", "", registry=oracle)
    adapter_jobs = Counter("nllb_adapter_jobs", "", ["adapter"], registry=oracle)
    adapter_tokens = Counter("nllb_adapter_generated_tokens", "", ["adapter"], registry=oracle)
    adapter_compute = Histogram("nllb_adapter_compute_seconds", "", ["adapter"], buckets=_LAT, registry=oracle)
    ours = Metrics()
    updates = [("", 5, 0.0), ("fra-reverse", 3, 0.005), ("", 0, 0.0051), ("x", 7, 120.0), ("", 2, 121.5),
               ("fra-reverse", 1, 0.25)]
    for adapter, n, seconds in updates:
        ours.translated(adapter or None, n, seconds)
        compute.observe(seconds)
        tokens.inc(n)
        adapter_jobs.labels(adapter).inc()
        adapter_tokens.labels(adapter).inc(n)
        adapter_compute.labels(adapter).observe(seconds)
    for outcome, code in [("ok", ""), ("error", "too_long"), ("ok", ""), ("stale", "")]:
        ours.job_done(outcome, code)
        jobs.labels(outcome, code).inc()

    def samples(text: bytes) -> set[str]:
        return {line for line in text.decode().splitlines()
                if not line.startswith("#") and "_created" not in line and line.split("{")[0].split(" ")[0] in names}

    names = {f"{m}{suffix}" for m in ("nllb_jobs", "nllb_generated_tokens", "nllb_adapter_jobs",
                                      "nllb_adapter_generated_tokens") for suffix in ("_total",)}
    names |= {f"{m}{suffix}" for m in ("nllb_job_compute_seconds", "nllb_adapter_compute_seconds")
              for suffix in ("_bucket", "_count", "_sum")}
    expected = samples(generate_latest(oracle))
    assert len(expected) == 3 + 1 + 3 + 3 + (3 + 1) * (len(_LAT) + 3) and samples(ours.render()) == expected
    assert (ours.count("ok"), ours.count("error", "too_long"), ours.count("requeue")) == (2, 1, 0)
    created = [line for line in ours.render().decode().splitlines() if line.startswith("nllb_jobs_created{")]
    assert len(created) == 3  # counters keep when each series was first counted
