"""1.1 through the broker, on the toy engine: document jobs, progress (partial messages),
src_lang "auto", warnings and on_warning retry. Oracles: the engine's own answers, and the
layout's round trip (engine.text.segment)."""
from __future__ import annotations

import asyncio
import random

import pytest
from conftest import run
from helpers import PlainProducer, eventually, in_process_worker, job

from engine.options import GenerationOptions
from engine.text.segment import reassemble, split_document
from tests.fixtures.make_toy import sample_sentence
from worker.progress import INTERVAL_S

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(180)]

LOOPING = "rema sila " * 8  # the toy's copy task (fra_Latn) loops on it: repetition


def document(seed: int, sentences: int) -> str:
    """Toy sentences in paragraphs, with indentation, CRLF, trailing and Unicode spaces."""
    rng = random.Random(seed)
    gaps = ["\n", "\n\n", "  ", "\r\n", " \u00a0", "\n    "]
    parts = ["  "]
    for i in range(sentences):
        parts += [f"{sample_sentence(rng).capitalize()}.", rng.choice(gaps)]
    return "".join(parts) + "\n"


def doc_job(text: str, **kw) -> dict:
    body = job("x", **kw)
    del body["text"]
    body["document"] = text
    return body


def test_document_reply_is_the_layout_round_trip_of_each_sentences_translation(settings, names, engine, broker):
    doc = document(3, 12) + document(3, 3)  # repeated sentences are decoded once
    layout = split_document(doc, "eng_Latn")
    alone = [engine.translate([s], "eng_Latn", "deu_Latn")[0] for s in layout.sentences]

    async def body():
        async with in_process_worker(settings, engine), \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            r = await p.one(doc_job(doc, tgt="deu_Latn", options={"return_segments": True}))
            assert r["status"] == "ok", r
            assert "translations" not in r and r["document"] == reassemble(layout, [t.text for t in alone])
            assert r["segments"] == [{"source": s, "text": t.text} for s, t in zip(layout.sentences, alone)]
            unique = dict(zip(layout.sentences, alone))
            assert len(unique) < len(layout.sentences)
            assert r["usage"] == {"segments": len(layout.sentences), "unique_segments": len(unique),
                                  "src_tokens": sum(t.src_tokens for t in unique.values()),
                                  "tgt_tokens": sum(len(t.tokens) for t in unique.values())}
            assert set(r["timings_ms"]) == {"queued", "compute"}
            plain = await p.one(doc_job(doc, tgt="deu_Latn"))
            assert plain["document"] == r["document"] and "segments" not in plain
    run(body(), 120)


def test_document_over_the_limit_is_too_long_and_a_run_on_sentence_is_translated(settings, names, engine,
                                                                                  broker):
    rng = random.Random(5)
    run_on = " ".join(sample_sentence(rng, 1) for _ in range(3000))  # one sentence, far over the token limit
    settings = settings.model_copy(update={"max_document_chars": len(run_on)})
    want = engine.submit_document(run_on, "eng_Latn", "fra_Latn",
                                  options=GenerationOptions(max_new_tokens=8)).result(60)

    async def body():
        async with in_process_worker(settings, engine), \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            r = await p.one(doc_job(run_on, options={"max_new_tokens": 8}))
            assert r["status"] == "ok", r
            assert r["document"] == want.text and r["usage"]["segments"] > 1
            over = await p.one(doc_job(run_on + "x"))
            assert over["status"] == "error" and over["error"]["code"] == "too_long"
            assert f"at most {len(run_on):,} (NLLB_MAX_DOCUMENT_CHARS)" in over["error"]["message"]
            both = await p.one(dict(doc_job("Hello."), texts=["Hello."]))
            assert both["error"]["code"] == "invalid_request" and "'document'" in both["error"]["message"]
    run(body(), 120)


def test_progress_partials_come_before_the_final_reply_with_unique_indices_in_range(settings, names, engine,
                                                                                   broker):
    doc = document(11, 1500)
    sentences = len(split_document(doc, "eng_Latn").sentences)

    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            cid = await p.publish(doc_job(doc, options={"progress": True, "min_new_tokens": 12}))
            texts = ["rema sila", "to ka", "tokala rema"]
            cid_texts = await p.publish(job(texts, options={"progress": True}))
            await eventually(lambda: all(any(m["status"] != "partial" for m in p.replies.get(c, []))
                                         for c in (cid, cid_texts)), 120, "the final replies")
            await asyncio.sleep(3 * INTERVAL_S)  # a partial published after the final would be in by now
            for c, total in ((cid, sentences), (cid_texts, len(texts))):
                *partials, final = p.replies[c]
                assert final["status"] == "ok" and all(m["status"] == "partial" for m in partials)
                assert partials, "no partial message before the final reply"
                indices = [s["index"] for m in partials for s in m["segments"]]
                assert len(indices) == len(set(indices)) and all(0 <= i < total for i in indices)
                assert [m["done"] for m in partials] == sorted(m["done"] for m in partials)
                assert all(m["total"] == total for m in partials)
                if c == cid_texts:
                    got = {s["index"]: s["text"] for m in partials for s in m["segments"]}
                    assert all(final["translations"][i]["text"] == text for i, text in got.items())
            assert len(p.replies[cid]) >= 3  # 1,500 sentences take over 0.5 s: more than one partial
            assert svc.metrics.partials._value.get() >= len(p.replies[cid]) - 1
    run(body(), 150)


def test_src_auto_answers_detected_language_per_text_and_once_per_document(settings, names, engine, broker):
    texts = ["The committee will meet on Tuesday to discuss the new budget.",
             "Le comité se réunira mardi pour discuter du nouveau budget."]
    want = engine.translate(texts, "auto", "deu_Latn")
    doc = "The committee will meet on Tuesday.  It will discuss the budget.\n\nSee you there.\n"
    want_doc = engine.submit_document(doc, "auto", "fra_Latn").result(30)

    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            r = await p.one(job(texts, src="auto", tgt="deu_Latn"))
            assert r["status"] == "ok" and r["src_lang"] == "auto", r
            assert [(t["text"], t["detected_lang"]) for t in r["translations"]] == [
                (w.text, w.detected_lang) for w in want] == [(want[0].text, "eng_Latn"), (want[1].text, "fra_Latn")]
            assert [t["detected_confidence"] for t in r["translations"]] == pytest.approx(
                [w.detected_confidence for w in want], abs=1e-4)
            d = await p.one(doc_job(doc, src="auto", options={"return_segments": True}))
            assert d["document"] == want_doc.text and d["detected_lang"] == "eng_Latn"
            assert d["detected_confidence"] == pytest.approx(want_doc.detected_confidence, abs=1e-4)
            assert not any({"detected_lang", "detected_confidence"} & set(s) for s in d["segments"])  # once
            unknown = await p.one(job(["The committee will meet.", "rema sila to ka tokala"], src="auto"))
            assert unknown["error"]["code"] == "unknown_language" and "best guesses" in unknown["error"]["message"]
            assert svc.metrics.detections.labels("eng_Latn")._value.get() == 2
            assert svc.metrics.detections.labels("fra_Latn")._value.get() == 1
            assert svc.metrics.detection_unknown._value.get() == 1
    run(body(), 120)


def test_warnings_on_the_wire_and_retried_segments_marked(settings, names, engine, broker):
    texts = ["rema sila to ka tokala", "rema"]
    want_cut = engine.translate(texts, "eng_Latn", "fra_Latn", GenerationOptions(max_new_tokens=2))
    want_flagged = engine.translate([LOOPING, "rema sila to"], "eng_Latn", "fra_Latn")
    want_retried = engine.submit([LOOPING, "rema sila to"], "eng_Latn", "fra_Latn", on_warning="retry").result(60)

    async def body():
        async with in_process_worker(settings, engine) as svc, \
                PlainProducer(broker, names["jobs_queue"], names["reply_queue"]) as p:
            cut = await p.one(job(texts, options={"max_new_tokens": 2}))
            assert [t["warnings"] for t in cut["translations"]] == [w.warnings for w in want_cut]
            assert all("truncated" in t["warnings"] for t in cut["translations"])
            flagged = await p.one(job([LOOPING, "rema sila to"]))
            assert "repetition" in flagged["translations"][0]["warnings"]
            assert flagged["translations"][0]["warnings"] == want_flagged[0].warnings
            assert flagged["translations"][1] == {"text": want_flagged[1].text}  # nothing to say: left out
            retried = await p.one(job([LOOPING, "rema sila to"], options={"on_warning": "retry"}))
            first, second = retried["translations"]
            assert want_retried[0].retried and first == {"text": want_retried[0].text, "retried": True}
            assert second == flagged["translations"][1]  # the other segment untouched
            doc = await p.one(doc_job(f"{LOOPING.strip()}.\n\nRema sila to.", options={"return_segments": True}))
            assert "repetition" in doc["warnings"] and "repetition" in doc["segments"][0]["warnings"]
            assert doc["warnings"] == sorted({w for s in doc["segments"] for w in s.get("warnings", [])})
            bad = await p.one(job("rema", options={"on_warning": "ignore"}))
            assert bad["error"]["code"] == "invalid_request" and "on_warning" in bad["error"]["message"]
            assert svc.metrics.warnings.labels("repetition", "eng_Latn", "fra_Latn")._value.get() >= 2
            assert svc.metrics.warnings.labels("truncated", "eng_Latn", "fra_Latn")._value.get() == 2
            assert svc.metrics.retried._value.get() == 1
    run(body(), 120)
