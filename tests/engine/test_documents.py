"""Document jobs: layout kept, each sentence translated as it is alone, long sentences cut not refused,
repeated sentences decoded once, progress per sentence."""
from __future__ import annotations

import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine
from engine.errors import InvalidRequest, TooLong
from tests.fixtures.make_toy import sample_sentence, sample_word

SPACES = [" ", "  ", "\t", "\u00a0", "\u3000", "\u2003"]  # Python's str.isspace() holds each


def put_in_place(doc: str, sources: list[str], translations: list[str]) -> str:
    """The document with each source sentence, found in order, replaced by its translation; asserts that
    only whitespace lies between them (the sentences cover the document)."""
    out, at = [], 0
    for source, translation in zip(sources, translations):
        start = doc.index(source, at)
        assert not doc[at:start].strip(), f"text between sentences: {doc[at:start]!r}"
        out += [doc[at:start], translation]
        at = start + len(source)
    assert not doc[at:].strip()
    return "".join(out) + doc[at:]


@st.composite
def documents(draw) -> str:
    """Lines of toy-model sentences (several a line, joined by '. '), blank lines, indentation, trailing and
    Unicode spaces, LF or CRLF endings."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    ending = draw(st.sampled_from(["\n", "\r\n"]))
    lines = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()) and lines:
            lines.append(draw(st.sampled_from(["", " ", "\t  "])))  # a blank line
            continue
        indent = "".join(draw(st.lists(st.sampled_from(SPACES), max_size=2)))
        trail = "".join(draw(st.lists(st.sampled_from(SPACES), max_size=2)))
        between = draw(st.sampled_from([". ", ".  ", ".\u00a0"]))
        body = between.join(sample_sentence(rng) for _ in range(draw(st.integers(1, 3))))
        lines.append(indent + body + trail)
    return ending.join(lines) + draw(st.sampled_from(["", ending]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=documents())
def test_document_keeps_its_layout_and_each_sentence_is_translated_as_alone(engine, doc):
    result = engine.submit_document(doc, "eng_Latn", "deu_Latn").result(60)
    sources = [s.source for s in result.segments]
    assert all(source == source.strip() and source for source in sources)
    assert result.text == put_in_place(doc, sources, [s.translation.text for s in result.segments])
    alone = [engine.submit([s], "eng_Latn", "deu_Latn") for s in sources]
    assert [s.translation.tokens for s in result.segments] == [f.result(60)[0].tokens for f in alone]


def test_run_on_sentence_of_3000_words_is_cut_to_fit_and_translated(engine):
    rng = random.Random(11)
    doc = " ".join(sample_word(rng) for _ in range(3000))
    result = engine.submit_document(doc, "eng_Latn", "fra_Latn").result(300)
    assert result.usage.segments > 1
    assert all(len(engine.tokenizer.encode_source(s.source, "eng_Latn")) <= engine.max_source_tokens
               for s in result.segments)
    sources = [s.source for s in result.segments]
    assert result.text == put_in_place(doc, sources, [s.translation.text for s in result.segments])
    assert all(s.translation.tokens for s in result.segments)


def test_document_over_max_chars_is_too_long_and_one_at_the_limit_is_translated(engine):
    doc = "rema sila. tokala mesu."
    with pytest.raises(TooLong, match=str(len(doc) - 1)):
        engine.submit_document(doc, "eng_Latn", "fra_Latn", max_chars=len(doc) - 1)
    assert engine.submit_document(doc, "eng_Latn", "fra_Latn", max_chars=len(doc)).result(30).text


@pytest.mark.parametrize("doc", ["", " \n\t\r\n", "\u3000"])
def test_blank_document_is_an_invalid_request(engine, doc):
    with pytest.raises(InvalidRequest):
        engine.submit_document(doc, "eng_Latn", "fra_Latn")


def test_repeated_sentences_are_decoded_once_and_answer_every_place(toy_dir):
    eng = Engine.load(toy_dir, device="cpu", max_rows=8)
    admitted = []
    admit = eng.scheduler.admit

    def counting_admit():
        segments = admit()
        admitted.extend(segments)
        return segments
    eng.scheduler.admit = counting_admit
    try:
        doc = "rema sila. tokala mesu.\nrema sila.\n\n  tokala mesu. rema sila. kizetu.\n"
        result = eng.submit_document(doc, "eng_Latn", "fra_Latn").result(30)
    finally:
        eng.close()
    sources = [s.source for s in result.segments]
    assert len(sources) == 6 and len(set(sources)) == 3
    assert len(admitted) == 3 and sorted(s.src_ids for s in admitted) == sorted(
        eng.tokenizer.encode_source(s, "eng_Latn") for s in set(sources))
    by_source = {}
    for seg in result.segments:
        assert by_source.setdefault(seg.source, seg.translation.tokens) == seg.translation.tokens
    assert (result.usage.segments, result.usage.unique_segments) == (6, 3)
    assert result.usage.src_tokens == sum(len(s.src_ids) for s in admitted)
    assert result.usage.tgt_tokens == sum(len(by_source[s]) for s in set(sources))
    assert result.usage.queued_s >= 0 and result.usage.compute_s > 0


def test_each_sentence_is_reported_once_from_the_engine_thread_before_the_answer(engine):
    rng = random.Random(4)
    doc = "\n".join(f"{sample_sentence(rng)}. {sample_sentence(rng)}." for _ in range(20))
    calls = []
    future = None

    def on_segment(index, translation):
        calls.append((index, translation.tokens, threading.current_thread().name, future.done()))

    future = engine.submit_document(doc, "eng_Latn", "fra_Latn", on_segment=on_segment)
    result = future.result(60)
    indices = [index for index, *_ in calls]
    assert sorted(indices) == list(range(len(result.segments)))  # each index once, all in range
    assert all(tokens == result.segments[i].translation.tokens for i, tokens, _, _ in calls)
    assert {thread for *_, thread, _ in calls} == {"nllb-engine"}
    assert not any(done for *_, done in calls)  # every report came before the answer


def test_texts_job_reports_each_text_by_its_index(engine):
    calls = []
    texts = ["rema sila", "tokala mesu ri", "rema sila"]
    future = engine.submit(texts, "eng_Latn", "fra_Latn", on_segment=lambda i, t: calls.append((i, t.tokens)))
    result = future.result(30)
    assert sorted(calls) == sorted((i, t.tokens) for i, t in enumerate(result))


def test_a_failing_progress_callback_is_logged_and_the_job_and_engine_go_on(engine, caplog):
    def broken(index, translation):
        raise RuntimeError("the submitter's bug")

    result = engine.submit_document("rema sila. tokala mesu.", "eng_Latn", "fra_Latn", on_segment=broken).result(30)
    assert len(result.segments) == 2
    assert "on_segment callback failed" in caplog.text
    assert engine.translate(["rema sila"], "eng_Latn", "fra_Latn")[0].tokens


def test_the_future_says_how_many_segments_answer_the_job_before_it_finishes(engine):
    doc = "rema sila.  rema sila.\n\nto ka tokala.\n"
    future = engine.submit_document(doc, "eng_Latn", "fra_Latn")
    assert future.total == 3  # every sentence, a repeated one at each of its places
    assert len(future.result(30).segments) == future.total
    texts = engine.submit(["rema", "sila", "to"], "eng_Latn", "fra_Latn")
    assert texts.total == 3 and len(texts.result(30)) == 3
