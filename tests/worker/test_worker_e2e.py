"""End to end against a real broker: a plain aio-pika producer, an in-process worker on the real
toy engine. Replies equal Engine.translate; every PROTOCOL.md error code comes back for the input
that should cause it; unanswerable messages end in the dead-letter queue."""
from __future__ import annotations

import asyncio
import time

import aio_pika
import orjson
import pytest
from conftest import run, settled_counts
from helpers import PlainProducer, eventually, in_process_worker, job

from engine.options import GenerationOptions

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(180)]

TEXTS = ["hello world", "the cat sat on the mat", "a b c d e f", "good morning to you"]


def test_replies_match_engine_translate(settings, names, engine, broker):
    cases = [
        ("fra_Latn", {}),
        ("deu_Latn", {}),
        ("fra_Latn", {"num_beams": 4}),
        ("deu_Latn", {"num_beams": 3, "num_return_sequences": 2, "length_penalty": 0.8}),
        ("fra_Latn", {"max_new_tokens": 3}),
        ("fra_Latn", {"do_sample": True, "seed": 7, "top_k": 5}),
    ]
    expected = []
    for tgt, opts in cases:
        out = engine.translate(TEXTS, "eng_Latn", tgt, options=GenerationOptions(**opts) if opts else None)
        expected.append(out)

    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            cids = []
            for tgt, opts in cases:
                o = dict(opts, return_tokens=True, return_scores=True)
                cids.append(await p.publish(job(TEXTS, tgt=tgt, options=o)))
            await p.wait_for(cids, 120)
            for cid, (tgt, opts), exp in zip(cids, cases, expected):
                r = p.replies[cid][0]
                assert r["status"] == "ok", r
                assert r["v"] == 1 and r["tgt_lang"] == tgt and r["src_lang"] == "eng_Latn"
                assert r["model"] == engine.model_name
                got = r["translations"]
                assert [t["tokens"] for t in got] == [list(e.tokens) for e in exp]
                assert [t["text"] for t in got] == [e.text for e in exp]
                for t, e in zip(got, exp):
                    assert t["score"] == pytest.approx(float(e.score), rel=1e-4, abs=1e-4)
                    if opts.get("num_return_sequences", 1) > 1:
                        assert [h["tokens"] for h in t["hypotheses"]] == [list(h.tokens) for h in e.hypotheses]
                    else:
                        assert "hypotheses" not in t
                assert r["usage"]["tgt_tokens"] == sum(len(e.tokens) for e in exp)
                assert r["usage"]["src_tokens"] == sum(e.src_tokens for e in exp)
                assert set(r["timings_ms"]) == {"queued", "compute"}
            # without return_tokens/return_scores the fields are left out; `text` shorthand works
            r = await p.one(job("hello world"))
            assert r["status"] == "ok" and set(r["translations"][0]) == {"text"}
            assert r["translations"][0]["text"] == expected[0][0].text
            await eventually(lambda: svc.metrics.count("ok") == len(cases) + 1)
        assert settled_counts(names["jobs_queue"]) == (0, 0)
    run(body(), 170)


def error_cases(engine):
    long_text = " ".join(["hello"] * (engine.max_source_tokens + 10))
    return [
        # (description, body or raw bytes, expected code)
        ("not JSON", b"{nope", "invalid_request"),
        ("not UTF-8", b"\xff\xfe", "invalid_request"),
        ("JSON array", b"[1, 2]", "invalid_request"),
        ("wrong version", {"v": 2, "text": "hi", "src_lang": "eng_Latn", "tgt_lang": "fra_Latn"}, "invalid_request"),
        ("version as a string", {"v": "1", "text": "hi", "src_lang": "eng_Latn", "tgt_lang": "fra_Latn"},
         "invalid_request"),
        ("text and texts", job("hi", texts=["x"]), "invalid_request"),
        ("neither text nor texts", {"v": 1, "src_lang": "eng_Latn", "tgt_lang": "fra_Latn"}, "invalid_request"),
        ("empty texts", job([]), "invalid_request"),
        ("texts not strings", job([1, 2]), "invalid_request"),
        ("unknown top-level field", job("hi", colour="red"), "invalid_request"),
        ("unknown option", job("hi", options={"num_beam": 4}), "invalid_request"),
        ("option of the wrong type", job("hi", options={"num_beams": "4"}), "invalid_request"),
        ("bad option value", job("hi", options={"num_beams": 0}), "invalid_request"),
        ("bad option combination", job("hi", options={"num_beams": 2, "num_return_sequences": 3}), "invalid_request"),
        ("top_p out of range", job("hi", options={"top_p": 1.5}), "invalid_request"),
        ("missing tgt_lang", {"v": 1, "text": "hi", "src_lang": "eng_Latn"}, "invalid_request"),
        ("empty segment", job(["hello", ""]), "invalid_request"),
        ("unknown target language", job("hi", tgt="xx_Latn"), "unknown_language"),
        ("unknown source language", job("hi", src="english"), "unknown_language"),
        ("unknown adapter", job("hi", adapter="no-such-adapter"), "unknown_adapter"),
        ("segment too long", job(long_text), "too_long"),
        ("too many segments", job(["hi"] * 300), "too_long"),
        ("deadline passed", job("hi", deadline_ms=int(time.time() * 1000) - 1000), "deadline_exceeded"),
    ]


def test_every_error_code(settings, names, engine, broker):
    cases = error_cases(engine)

    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            cids = [await p.publish(b, message_id=f"mid-{i}") for i, (_, b, _) in enumerate(cases)]
            await p.wait_for(cids, 60)
            for i, (cid, (what, b, code)) in enumerate(zip(cids, cases)):
                r = p.replies[cid][0]
                assert r["status"] == "error", (what, r)
                assert r["error"]["code"] == code, (what, r)
                assert r["error"]["retryable"] is False, (what, r)
                assert r["error"]["message"], what
                want_id = b["id"] if isinstance(b, dict) and "id" in b else f"mid-{i}"
                assert r["id"] == want_id, (what, r)
                assert len(p.replies[cid]) == 1
            n_invalid = sum(c == "invalid_request" for *_, c in cases)
            await eventually(lambda: svc.metrics.count("error", "invalid_request") == n_invalid)
        assert settled_counts(names["jobs_queue"]) == (0, 0)
    run(body(), 120)


def test_deadline_checked_again_by_engine(settings, names, engine, broker):
    """A deadline that is still ahead on receipt but passes while the job waits for rows."""
    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            # fill the engine with slow work, then send a job whose deadline falls while it waits
            # segments that hold their rows for long: the engine hands freed rows to waiting jobs
            # first, so only a table full of long segments keeps the new job waiting
            big = [job(["the cat sat on the mat"] * 8, options={"num_beams": 4, "min_new_tokens": 200,
                                                                 "max_new_tokens": 200}) for _ in range(6)]
            busy = [await p.publish(b) for b in big]
            await asyncio.sleep(0.3)
            cid = await p.publish(job("hello world", deadline_ms=int(time.time() * 1000) + 150))
            await p.wait_for(busy + [cid], 120)
            r = p.replies[cid][0]
            assert r["status"] == "error" and r["error"]["code"] == "deadline_exceeded", r
            await eventually(lambda: svc.metrics.count("error", "deadline_exceeded") == 1)
    run(body(), 170)


def test_a_deadline_that_passes_while_the_job_decodes_is_answered_deadline_exceeded(settings, names, engine,
                                                                                    broker):
    """Not only while it waits: a job still decoding at its deadline is answered deadline_exceeded then, not
    translated seconds later."""
    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            # 32 rows, under the engine's per-job cap, so every segment starts at once; ~1 s of decoding alone
            long = {"num_beams": 4, "min_new_tokens": 200, "max_new_tokens": 200}
            deadline_ms = int(time.time() * 1000) + 500
            cid = await p.publish(job(["the cat sat on the mat"] * 8, options=long, deadline_ms=deadline_ms))
            await p.wait_for([cid], 60)
            late_ms = time.time() * 1000 - deadline_ms
            r = p.replies[cid][0]
            assert r["status"] == "error" and r["error"]["code"] == "deadline_exceeded", r
            assert "before it finished" in r["error"]["message"] and late_ms < 1000
            await eventually(lambda: svc.metrics.count("error", "deadline_exceeded") == 1)
        assert settled_counts(names["jobs_queue"]) == (0, 0)
    run(body(), 90)


def test_unanswerable_messages_are_dead_lettered(settings, names, engine, broker):
    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            await p.publish(b"\x00garbage", reply=False, message_id="garbage")
            await p.publish(job("hello world"), reply=False, message_id="no-reply-to")
            ok = await p.one(job("hello world"))  # the worker keeps serving
            assert ok["status"] == "ok"
            dead = await p.dead_letters(names["dead_letter_queue"], 2, 20)
            assert sorted(m.message_id for m in dead) == ["garbage", "no-reply-to"]
            assert dead[0].headers["x-death"][0]["reason"] == "rejected"
            await eventually(lambda: svc.metrics.count("dead_letter", "unanswerable") == 2)
        assert settled_counts(names["jobs_queue"]) == (0, 0)
    run(body(), 60)


def test_a_job_whose_reply_cannot_be_delivered_is_dead_lettered_not_dropped(settings, names, engine, broker):
    """PROTOCOL: a job ends as a reply or as a dead letter. A reply_to that names no queue (never declared, or
    deleted while the job ran) returns its reply unroutable; a reply queue that stays full and rejects publishes
    nacks it for reply_refused_after_s. Either way the job goes to the dead letters, where its producer can find
    it; the jobs around them are answered."""
    settings = settings.model_copy(update={"reply_refused_after_s": 1.0})
    full = f"{names['reply_queue']}.full"

    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            ch = await p.conn.channel()
            await ch.declare_queue(full, auto_delete=True,
                                   arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
            await p.publish(job("hello world"), reply_to="nllb.test.no-such-queue", message_id="gone")
            await p.publish(job("hello world"), reply_to=full, message_id="full")
            ok = await p.one(job("hello world"))
            assert ok["status"] == "ok"
            dead = await p.dead_letters(names["dead_letter_queue"], 2, 30)
            assert sorted(m.message_id for m in dead) == ["full", "gone"]
            assert all(m.headers["x-death"][0]["reason"] == "rejected" for m in dead)
            assert svc.metrics.count("undeliverable", "reply_returned") == 1
            assert svc.metrics.count("undeliverable", "reply_refused") == 1
            await ch.close()
        assert settled_counts(names["jobs_queue"]) == (0, 0)
    run(body(), 90)


def test_a_job_answered_through_direct_reply_to_is_answered_once_and_not_dead_lettered(settings, names, engine,
                                                                                       broker):
    """reply_to `amq.rabbitmq.reply-to` (RabbitMQ's direct reply-to): the broker returns a mandatory publish to it
    even as it delivers it, so the reply goes without mandatory; the job is answered, not also dead-lettered."""
    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            ch = await p.conn.channel()
            direct: list[aio_pika.abc.AbstractIncomingMessage] = []
            pseudo_queue = await ch.get_queue("amq.rabbitmq.reply-to", ensure=False)
            await pseudo_queue.consume(direct.append, no_ack=True)
            jobs = [job(text) for text in TEXTS]
            for i, j in enumerate(jobs):
                await ch.default_exchange.publish(
                    aio_pika.Message(orjson.dumps(j), correlation_id=f"direct-{i}", reply_to="amq.rabbitmq.reply-to"),
                    routing_key=names["jobs_queue"])
            await eventually(lambda: len(direct) == len(jobs), 30, "every direct reply")
            assert sorted(m.correlation_id for m in direct) == [f"direct-{i}" for i in range(len(jobs))]
            assert all(orjson.loads(m.body)["status"] == "ok" for m in direct)
            assert await p.dead_letters(names["dead_letter_queue"], 1, 2) == []
            assert svc.metrics.count("ok") == len(jobs) and svc.metrics.count("undeliverable", "reply_returned") == 0
            await ch.close()
        assert settled_counts(names["jobs_queue"]) == (0, 0)
    run(body(), 90)


def test_adapter_jobs_are_answered_with_the_adapter_named_and_counted(settings, names, broker):
    """A job naming the committed fra-reverse adapter gets its tokens, the reply names the adapter,
    and the per-adapter metrics count it beside base-model jobs."""
    from engine import TOY_MODEL_DIR, Engine

    eng = Engine.load(None, device="cpu", max_rows=16, adapters_dir=TOY_MODEL_DIR.parent / "adapters")
    text = "ta deshacho lidor tu nizela"
    want = {name: eng.translate([text], "eng_Latn", "fra_Latn", adapter=name)[0].tokens
            for name in (None, "fra-reverse")}
    assert want[None] != want["fra-reverse"]

    async def body():
        async with in_process_worker(settings, eng) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            plain = await p.publish(job(text, options={"return_tokens": True}))
            tuned = await p.publish(job(text, adapter="fra-reverse", options={"return_tokens": True}))
            await p.wait_for([plain, tuned], 60)
            assert p.replies[plain][0]["translations"][0]["tokens"] == want[None]
            reply = p.replies[tuned][0]
            assert reply["adapter"] == "fra-reverse"
            assert reply["translations"][0]["tokens"] == want["fra-reverse"]
            metrics = svc.metrics.render().decode()
            assert 'nllb_adapter_jobs_total{adapter="fra-reverse"} 1.0' in metrics
            assert 'nllb_adapter_jobs_total{adapter=""} 1.0' in metrics
    try:
        run(body(), 90)
    finally:
        eng.close()
