"""Output warnings on each translation, on_warning="retry", and src_lang "auto" through the engine."""
from __future__ import annotations

import random

import pytest

from engine import GenerationOptions
from engine.errors import InvalidRequest, UnknownLanguage
from engine.submission import retry_options
from tests.fixtures.make_toy import sample_sentence

LOOPING = "rema sila " * 8  # the copy task (fra_Latn) copies the loop: repetition
RETRY = GenerationOptions(num_beams=4, repetition_penalty=1.2, no_repeat_ngram_size=3)


def test_normal_outputs_carry_no_warnings(engine):
    rng = random.Random(21)
    texts = [sample_sentence(rng) for _ in range(30)]
    for tgt in ("fra_Latn", "deu_Latn"):
        assert all(t.warnings == [] for t in engine.translate(texts, "eng_Latn", tgt))


def test_a_looping_output_is_flagged_repetition_and_left_as_it_is(engine):
    flagged, plain = engine.translate([LOOPING, "rema sila to"], "eng_Latn", "fra_Latn")
    assert "repetition" in flagged.warnings and not flagged.retried
    assert plain.warnings == []


@pytest.mark.parametrize("options", [GenerationOptions(max_new_tokens=2),
                                     GenerationOptions(max_new_tokens=2, num_beams=3)])
def test_output_cut_at_max_new_tokens_is_truncated(engine, options):
    cut, = engine.translate(["rema sila to ka tokala"], "eng_Latn", "fra_Latn", options)
    assert len(cut.tokens) == 1 and "truncated" in cut.warnings  # the language token was the first new one
    whole, = engine.translate(["rema"], "eng_Latn", "fra_Latn", GenerationOptions(max_new_tokens=20))
    assert "truncated" not in whole.warnings


def test_retry_keeps_a_clean_second_decode_and_leaves_the_other_segments_alone(engine):
    reported = {}
    future = engine.submit([LOOPING, "rema sila to"], "eng_Latn", "fra_Latn", on_warning="retry",
                           on_segment=lambda i, t: reported.setdefault(i, []).append(t))
    retried, untouched = future.result(60)
    oracle, = engine.translate([LOOPING], "eng_Latn", "fra_Latn", RETRY)
    assert retried.retried and retried.warnings == [] and retried.tokens == oracle.tokens
    plain = engine.translate(["rema sila to"], "eng_Latn", "fra_Latn")[0]
    assert not untouched.retried and untouched.tokens == plain.tokens
    assert {i: [t.tokens for t in ts] for i, ts in reported.items()} == {0: [retried.tokens], 1: [untouched.tokens]}


def test_retry_that_does_not_clear_the_warning_returns_the_first_decode(engine):
    options = GenerationOptions(max_new_tokens=2)
    first, = engine.translate(["rema sila to ka"], "eng_Latn", "fra_Latn", options)
    kept, = engine.submit(["rema sila to ka"], "eng_Latn", "fra_Latn", options, on_warning="retry").result(30)
    assert "truncated" in first.warnings
    assert kept.tokens == first.tokens and kept.warnings == first.warnings and not kept.retried


def test_retry_options_fill_only_what_the_job_left_at_its_default():
    assert retry_options(GenerationOptions(), 64) == RETRY
    own = GenerationOptions(num_beams=2, repetition_penalty=1.5, no_repeat_ngram_size=4, max_new_tokens=30)
    assert retry_options(own, 64) == own
    assert retry_options(GenerationOptions(do_sample=True, seed=3), 64) == RETRY.__class__(
        num_beams=4, repetition_penalty=1.2, no_repeat_ngram_size=3, seed=3)
    assert retry_options(GenerationOptions(), 2).num_beams == 2  # never wider than the table


def test_on_warning_must_be_flag_or_retry(engine):
    with pytest.raises(InvalidRequest, match="on_warning"):
        engine.submit(["rema"], "eng_Latn", "fra_Latn", on_warning="ignore")


def test_token_jobs_have_no_text_services(engine):
    ids = engine.tokenizer.encode_source("rema sila to ka", "eng_Latn")
    cut, = engine.generate([ids], "fra_Latn", GenerationOptions(max_new_tokens=2))
    assert cut.warnings == [] and cut.detected_lang is None


def test_auto_detects_each_texts_language_and_translates_as_if_given(engine):
    texts = ["The committee will meet on Tuesday to discuss the new budget.",
             "Le comité se réunira mardi pour discuter du nouveau budget."]
    detected = engine.translate(texts, "auto", "deu_Latn")
    assert [t.detected_lang for t in detected] == ["eng_Latn", "fra_Latn"]
    assert all(0.5 <= t.detected_confidence <= 1 for t in detected)
    given = [engine.translate([text], lang, "deu_Latn")[0] for text, lang in zip(texts, ["eng_Latn", "fra_Latn"])]
    assert [t.tokens for t in detected] == [t.tokens for t in given]
    assert all(t.detected_lang is None for t in given)


@pytest.mark.parametrize("text, guesses", [("rema sila to ka tokala", r"best guesses: \w+_\w+ 0\.\d\d"),
                                           ("12345 678", "none")])
def test_auto_without_a_confident_language_is_unknown_language_with_the_best_guesses(engine, text, guesses):
    with pytest.raises(UnknownLanguage, match=guesses):
        engine.submit(["The committee will meet on Tuesday.", text], "auto", "fra_Latn")


def test_auto_detects_a_document_once(engine):
    doc = "The committee will meet on Tuesday.  It will discuss the budget.\n\nSee you there.\n"
    detected = engine.submit_document(doc, "auto", "fra_Latn").result(30)
    given = engine.submit_document(doc, "eng_Latn", "fra_Latn").result(30)
    assert detected.detected_lang == "eng_Latn" and detected.detected_confidence > 0.5
    assert given.detected_lang is None and given.detected_confidence is None
    assert detected.text == given.text
    assert [s.translation.tokens for s in detected.segments] == [s.translation.tokens for s in given.segments]


@pytest.fixture(scope="module")
def unchecked_engine(toy_dir):
    from engine import Engine
    eng = Engine.load(toy_dir, device="cpu", max_rows=8, output_warnings=False, langid_threshold=0.999)
    yield eng
    eng.close()


def test_output_warnings_off_gives_the_same_tokens_without_warnings(engine, unchecked_engine):
    options = GenerationOptions(max_new_tokens=2)
    checked, = engine.translate([LOOPING], "eng_Latn", "fra_Latn", options)
    unchecked, = unchecked_engine.translate([LOOPING], "eng_Latn", "fra_Latn", options)
    assert checked.warnings and unchecked.warnings == [] and unchecked.tokens == checked.tokens
    with pytest.raises(InvalidRequest, match="does not check outputs"):
        unchecked_engine.submit([LOOPING], "eng_Latn", "fra_Latn", on_warning="retry")


def test_the_detection_threshold_is_the_engines_setting(engine, unchecked_engine):
    text = "Le comité se réunira mardi pour discuter du nouveau budget."
    detected, = engine.translate([text], "auto", "deu_Latn")
    assert detected.detected_lang == "fra_Latn" and detected.detected_confidence < 0.999
    with pytest.raises(UnknownLanguage, match="best guesses: fra_Latn"):
        unchecked_engine.submit([text], "auto", "deu_Latn")


def test_check_outputs_false_leaves_the_warnings_to_the_caller_but_for_retry(engine):
    options = GenerationOptions(max_new_tokens=2)
    checked = engine.translate([LOOPING, "rema sila to ka"], "eng_Latn", "fra_Latn", options)
    left = engine.submit([LOOPING, "rema sila to ka"], "eng_Latn", "fra_Latn", options,
                         check_outputs=False).result(30)
    assert [t.tokens for t in left] == [t.tokens for t in checked]
    assert all("truncated" in t.warnings and t.truncated for t in checked)
    assert all(t.warnings == [] and t.truncated for t in left)
    retried, = engine.submit([LOOPING], "eng_Latn", "fra_Latn", on_warning="retry", check_outputs=False).result(30)
    assert retried.retried and retried.warnings == []  # checked in the engine, and clean after the retry
