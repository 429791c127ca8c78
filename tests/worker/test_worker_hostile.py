"""Hostile and careless producers through the real broker: oversized bodies, text Unicode does not
allow, long names, unknown adapters. Each gets a clear, non-retryable error reply that gives
nothing away, and the worker goes on serving."""
from __future__ import annotations

import json
import struct
import threading
import time

import pytest
from aiormq.abc import ChannelFrame
from conftest import run, settled_counts
from helpers import PlainProducer, eventually, in_process_worker, job

from engine import TOY_ADAPTERS_DIR, TOY_MODEL_DIR, Engine

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(120)]


def error_of(reply: dict) -> tuple[str, bool, str]:
    assert reply["status"] == "error", reply
    return reply["error"]["code"], reply["error"]["retryable"], reply["error"]["message"]


def test_size_limits_are_checked_before_parsing_and_tokenizing(settings, names, engine, broker):
    small = settings.model_copy(update={"max_message_bytes": 4096, "max_segment_chars": 300})

    async def body():
        async with in_process_worker(small, engine), \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            big = json.dumps(job("hello " * 1000)).encode()
            code, retryable, message = error_of(await p.one(big, message_id="big"))
            assert (code, retryable) == ("too_long", False)
            assert f"{len(big):,} bytes" in message and "4,096" in message and "NLLB_MAX_MESSAGE_BYTES" in message
            code, _, message = error_of(await p.one(job(["hello", "word " * 61])))
            assert code == "too_long" and "segment 1 has 305 characters" in message and "300" in message
            assert (await p.one(job("hello world")))["status"] == "ok"
        assert settled_counts(names["jobs_queue"]) == (0, 0)
    run(body(), 60)


def test_version_is_optional_and_only_1(settings, names, engine, broker):
    async def body():
        async with in_process_worker(settings, engine), \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            unversioned = {k: v for k, v in job("hello world").items() if k != "v"}
            assert (await p.one(unversioned))["status"] == "ok"
            for v in (2, 0, "1", None, 1.5, True, 1.0):  # true and 1.0 equal 1 in Python, not on the wire
                code, retryable, message = error_of(await p.one(job("hello", v=v)))
                assert (code, retryable) == ("invalid_request", False) and "v" in message
    run(body(), 60)


# Raw bodies: JSON \u escapes that are not Unicode, in every place a producer can put them.
UNENCODABLE = [
    ("lone high surrogate in text", b'{"v": 1, "id": "u1", "src_lang": "eng_Latn", "tgt_lang": "fra_Latn", '
                                    b'"text": "a\\ud800b"}', "'text'"),
    ("lone low surrogate in texts[1]", b'{"v": 1, "id": "u2", "src_lang": "eng_Latn", "tgt_lang": "fra_Latn", '
                                       b'"texts": ["fine", "\\udc00x"]}', "'texts[1]'"),
    ("reversed pair", b'{"v": 1, "id": "u3", "src_lang": "eng_Latn", "tgt_lang": "fra_Latn", '
                      b'"texts": ["ok", "ok", "\\ude00\\ud83d"]}', "'texts[2]'"),
    ("surrogate in the language", b'{"v": 1, "id": "u4", "src_lang": "eng_\\ud800", "tgt_lang": "fra_Latn", '
                                  b'"text": "x"}', "'src_lang'"),
    ("surrogate in the adapter", b'{"v": 1, "id": "u5", "src_lang": "eng_Latn", "tgt_lang": "fra_Latn", '
                                 b'"text": "x", "adapter": "\\udfff"}', "'adapter'"),
    ("surrogate in a field name", b'{"v": 1, "id": "u6", "src_lang": "eng_Latn", "tgt_lang": "fra_Latn", '
                                  b'"text": "x", "options": {"\\ud800": 1}}', "a field name in 'options'"),
    ("surrogate in the id", b'{"v": 1, "id": "\\ud800", "src_lang": "eng_Latn", "tgt_lang": "fra_Latn", '
                            b'"text": "x"}', "'id'"),
    ("deep nesting", b'{"v": 1, "text": "x", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests JSON"),
]


def test_text_unicode_does_not_allow_is_invalid_request_naming_where(settings, names, engine, broker):
    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            for i, (what, raw, where) in enumerate(UNENCODABLE):
                reply = await p.one(raw, message_id=f"mid-{i}")
                code, retryable, message = error_of(reply)
                assert (code, retryable) == ("invalid_request", False), what
                assert where in message, (what, message)
                assert reply["id"] == (f"mid-{i}" if what in ("surrogate in the id", "deep nesting")
                                       else f"u{i + 1}"), what
            assert svc.metrics.count("requeue", "worker_error") == 0
            assert (await p.one(job("a 😀 b")))["status"] == "ok"  # a real pair is fine
    run(body(), 90)


def test_names_are_echoed_short_and_adapters_are_not_given_away(settings, names, broker, tmp_path):
    eng = Engine.load(TOY_MODEL_DIR, device="cpu", max_rows=8, adapters_dir=TOY_ADAPTERS_DIR)
    listing = settings.model_copy(update={"list_adapters": True, "adapters_dir": TOY_ADAPTERS_DIR})
    shy = settings.model_copy(update={"adapters_dir": TOY_ADAPTERS_DIR})
    long_name = "x" * 5000

    async def body():
        async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            async with in_process_worker(shy, eng):
                for bad in (job("hi", tgt=long_name), job("hi", src=long_name), job("hi", adapter=long_name),
                            job("hi", **{long_name: 1}), job("hi", options={long_name: 1})):
                    code, retryable, message = error_of(await p.one(bad))
                    assert not retryable and "x" * 101 not in message and "characters)" in message, message
                code, _, message = error_of(await p.one(job("hi", adapter="other-tenant")))
                assert code == "unknown_adapter" and "'other-tenant'" in message
                assert "fra-reverse" not in message and str(TOY_ADAPTERS_DIR) not in message
                assert "/" not in message, message
            async with in_process_worker(listing, eng):
                code, _, message = error_of(await p.one(job("hi", adapter="other-tenant")))
                assert code == "unknown_adapter" and "fra-reverse" in message and "/" not in message
    try:
        run(body(), 90)
    finally:
        eng.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_60_mb_job_never_stalls_health_or_other_jobs(names, spawn, broker):
    """The body is parsed and checked off the event loop: /healthz, polled every 200 ms, answers
    within 1 s throughout, and a small job sent right after is answered promptly."""
    w = spawn("w", NLLB_MAX_MESSAGE_BYTES=64 * 2**20)  # let it be parsed, to show parsing is off the loop
    w.wait_ready()
    latencies: list[float] = []
    polling = threading.Event()

    def poll() -> None:
        while not polling.is_set():
            t0 = time.perf_counter()
            status, _ = w.http("/healthz")
            latencies.append(time.perf_counter() - t0)
            assert status == 200
            time.sleep(0.2)

    poller = threading.Thread(target=poll)
    poller.start()

    async def body():
        async with PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            huge = json.dumps(job("word " * 12_000_000)).encode()
            assert len(huge) > 60_000_000
            big = await p.publish(huge)
            t0 = time.perf_counter()
            small = await p.one(job("hello world"), timeout=30)
            small_s = time.perf_counter() - t0
            await p.wait_for([big], 60)
            return p.replies[big][0], small, small_s

    try:
        big, small, small_s = run(body(), 150)
        time.sleep(0.5)
    finally:
        polling.set()
        poller.join(10)
    print(f"\n60 MB job: {len(latencies)} /healthz answers, worst {max(latencies) * 1e3:.0f} ms; "
          f"small job answered in {small_s * 1e3:.0f} ms")
    code, retryable, message = error_of(big)
    assert (code, retryable) == ("too_long", False) and "NLLB_MAX_SEGMENT_CHARS" in message
    assert small["status"] == "ok" and small_s < 5
    assert max(latencies) < 1.0
    assert w.terminate() == 0


def short(raw: bytes) -> bytes:
    """An AMQP short string of any bytes."""
    return bytes((len(raw),)) + raw


def string_entry(name: bytes, value: bytes) -> bytes:
    """A field table's entry of a long string, name as given."""
    return short(name) + b"S" + struct.pack(">I", len(value)) + value


def raw_job_frames(routing_key: str, body: bytes, *, reply_to: bytes, correlation_id: bytes, message_id: bytes,
                   headers: bytes | None = None, timestamp: int | None = None, channel_number: int = 1) -> bytes:
    """A publish of `body` with property bytes as given, UTF-8 or not (a client of another language can send
    any bytes; pamqp encodes only str): content_type, headers (the table's encoded entries) when given,
    correlation_id, reply_to, message_id, timestamp when given, in Basic.Properties' wire order."""
    flags, values = 0x8000 | 0x0400 | 0x0200 | 0x0080, [short(b"application/json")]
    if headers is not None:
        flags |= 0x2000
        values.append(struct.pack(">I", len(headers)) + headers)
    values += [short(correlation_id), short(reply_to), short(message_id)]
    if timestamp is not None:
        flags |= 0x0040
        values.append(struct.pack(">Q", timestamp))

    def frame(kind: int, payload: bytes) -> bytes:
        return struct.pack(">BHI", kind, channel_number, len(payload)) + payload + b"\xce"

    method = struct.pack(">HHH", 60, 40, 0) + short(b"") + short(routing_key.encode()) + b"\x00"
    header = struct.pack(">HHQH", 60, 0, len(body), flags) + b"".join(values)
    return frame(1, method) + frame(2, header) + frame(3, body)


def test_properties_that_are_not_utf8_are_answered_and_the_connection_stays(settings, names, engine, broker):
    """Property strings and header names that are not UTF-8 (which pamqp cannot decode) reach the worker with
    U+FFFD in their place: a job with such a correlation or message id is answered, one whose reply_to is
    such a name has its reply returned (no queue has that name) and is dead-lettered; the worker's connection,
    and the jobs around them, are never disturbed."""
    bad = [dict(correlation_id=b"c-\xff\xfe", message_id=b"m-1"),
           dict(correlation_id=b"c-2", message_id=b"m-\xc0\xaf"),
           dict(correlation_id=b"c-3", message_id=b"m-3", headers=string_entry(b"k-\xed\xa0\x80", b"v")),
           dict(correlation_id=b"c-4", message_id=b"m-4", reply_to=b"r-\xff")]

    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            raw = await (await p.conn.channel(publisher_confirms=False)).get_underlay_channel()
            good = [await p.publish(job(f"sentence {i}")) for i in range(3)]
            for props in bad:
                props.setdefault("reply_to", names["reply_queue"].encode())
                frames = raw_job_frames(names["jobs_queue"], json.dumps(job("hello")).encode(),
                                        channel_number=raw.number, **props)
                await raw.write_queue.put(ChannelFrame(payload=frames, should_close=False))
            good += [await p.publish(job(f"sentence {i}")) for i in range(3, 6)]
            await p.wait_for(good + ["c-\ufffd\ufffd", "c-2", "c-3"], 60)
            assert all(p.replies[c][0]["status"] == "ok" for c in ["c-\ufffd\ufffd", "c-2", "c-3"])
            assert p.replies["c-2"][0]["status"] == "ok"
            await eventually(lambda: svc.metrics.count("undeliverable", "reply_returned") == 1, 20,
                             "the returned reply")
            assert [m.message_id for m in await p.dead_letters(names["dead_letter_queue"], 1, 20)] == ["m-4"]
            assert svc.metrics.reconnects._value.get() == 0 and svc.metrics.count("requeue", "worker_error") == 0
        assert settled_counts(names["jobs_queue"]) == (0, 0)
    run(body(), 90)


def nested_tables(depth: int) -> bytes:
    """A field table's entries {"a": {"a": ... {} ...}}, `depth` tables deep."""
    inner = b""
    for _ in range(depth):
        inner = short(b"a") + b"F" + struct.pack(">I", len(inner)) + inner
    return inner


def test_property_values_python_cannot_hold_are_answered_and_the_connection_stays(settings, names, engine, broker):
    """A timestamp in microseconds (past year 9999 as seconds), one inside the headers, and headers nested 1,000
    deep (other clients send them; the broker passes them on) once made every worker that took the job drop its
    connection and all it held, until the broker dead-lettered the job and the healthy jobs around it were
    redelivered. Each is answered, and no job around them is disturbed."""
    micros = int(time.time() * 1e6)
    odd = {"c-micros": dict(timestamp=micros),
           "c-header-time": dict(headers=string_entry(b"trace", b"t") + short(b"when") + b"T"
                                 + struct.pack(">Q", micros)),
           "c-deep": dict(headers=short(b"deep") + b"F" + struct.pack(">I", len(nested_tables(1000)))
                          + nested_tables(1000))}

    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            raw = await (await p.conn.channel(publisher_confirms=False)).get_underlay_channel()
            good = [await p.publish(job(f"sentence {i}")) for i in range(3)]
            for cid, props in odd.items():
                frames = raw_job_frames(names["jobs_queue"], json.dumps(job("hello")).encode(),
                                        channel_number=raw.number, reply_to=names["reply_queue"].encode(),
                                        correlation_id=cid.encode(), message_id=cid.encode(), **props)
                await raw.write_queue.put(ChannelFrame(payload=frames, should_close=False))
            good += [await p.publish(job(f"sentence {i}")) for i in range(3, 6)]
            await p.wait_for(good + list(odd), 60)
            assert all(len(p.replies[c]) == 1 and p.replies[c][0]["status"] == "ok" for c in good + list(odd))
            assert svc.metrics.reconnects._value.get() == 0 and svc.metrics.count("dead_letter") == 0
        assert settled_counts(names["jobs_queue"]) == (0, 0)
    run(body(), 90)
