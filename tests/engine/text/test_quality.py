"""Output warnings: silent on the toy model's normal outputs, firing on crafted failures (the copy
task on a repeating input, max_new_tokens 2, a target language in another script), and each rule
on hand-made outputs."""
from __future__ import annotations

import itertools
import random

import pytest

from engine.options import GenerationOptions, Translation
from engine.text.quality import (
    MIN_REPETITION_TOKENS,
    MIN_SCRIPT_LETTERS,
    NGRAM_SIZES,
    REPEATED_NGRAM_SHARE,
    TOKEN_RUN,
    WARNING_CODES,
    output_warnings,
)
from engine.text.scripts import script_counts
from tests.fixtures.make_toy import TASKS, sample_sentence

LIMIT = 40  # max_new_tokens of the engine runs below: far above the toy's 16 pieces


def warnings_of(engine, sources: list[str], tgt_lang: str, max_new_tokens: int = LIMIT) -> list[list[str]]:
    """Translate with the toy engine and warn as the engine does; truncated: the decoder used all
    of max_new_tokens (the forced language token is the first of them) without </s>."""
    results: list[Translation] = engine.translate(
        sources, "eng_Latn", tgt_lang, GenerationOptions(max_new_tokens=max_new_tokens))
    return [output_warnings(src, tr.text, tr.tokens, "eng_Latn", tgt_lang,
                            truncated=len(tr.tokens) + 1 >= max_new_tokens)
            for src, tr in zip(sources, results)]


@pytest.mark.parametrize("tgt_lang", sorted(TASKS))
def test_normal_toy_outputs_raise_no_warning(engine, tgt_lang: str) -> None:
    rng = random.Random(11)
    sources = [sample_sentence(rng) for _ in range(120)]
    flagged = [(s, w) for s, w in zip(sources, warnings_of(engine, sources, tgt_lang)) if w]
    assert flagged == []


def test_copy_task_on_repeating_input_warns_repetition(engine) -> None:
    sources = ["ka mi " * 8, "sha cho " * 7, "tora tora tora tora tora tora tora tora", "kamo " * 12]
    assert all("repetition" in w for w in warnings_of(engine, sources, "fra_Latn"))


def test_max_new_tokens_2_warns_truncated(engine) -> None:
    rng = random.Random(12)
    sources = [sample_sentence(rng) for _ in range(10)]
    assert all("truncated" in w for w in warnings_of(engine, sources, "fra_Latn", max_new_tokens=2))


@pytest.mark.parametrize("tgt_lang", ["rus_Cyrl", "zho_Hans"])
def test_target_in_another_script_warns_off_target(engine, tgt_lang: str) -> None:
    """The toy writes Latin letters for every target; for a Cyrillic or Han target each output
    with letters enough to judge is off target."""
    rng = random.Random(13)
    sources = [sample_sentence(rng) for _ in range(30)]
    results = engine.translate(sources, "eng_Latn", tgt_lang, GenerationOptions(max_new_tokens=LIMIT))
    judged = [(src, tr) for src, tr in zip(sources, results)
              if sum(script_counts(tr.text).values()) >= MIN_SCRIPT_LETTERS]
    assert len(judged) >= 10
    for src, tr in judged:
        assert "off_target" in output_warnings(src, tr.text, tr.tokens, "eng_Latn", tgt_lang, False)


# ---- each rule on hand-made outputs -----------------------------------------------------------

def warn(output: str, tokens: list[int] | None = None, source: str = "The weather is lovely today.",
         src_lang: str = "eng_Latn", tgt_lang: str = "fra_Latn", truncated: bool = False) -> list[str]:
    tokens = list(range(10, 10 + len(output.split()))) if tokens is None else tokens
    return output_warnings(source, output, tokens, src_lang, tgt_lang, truncated)


def test_a_good_translation_raises_nothing() -> None:
    assert warn("Il fait très beau aujourd'hui.") == []


def test_a_token_run_is_repetition() -> None:
    good = list(range(100, 160))  # long enough that the run is no n-gram loop
    assert "repetition" in warn("x", good + [7] * TOKEN_RUN)
    assert "repetition" not in warn("x", good + [7] * (TOKEN_RUN - 1))


def test_a_loop_after_a_long_good_start_is_repetition() -> None:
    good = list(range(100, 160))
    assert "repetition" in warn("x", good + [7, 8, 9, 10] * 10)
    assert "repetition" not in warn("x", good)


def test_a_short_output_is_not_judged_for_ngram_loops() -> None:
    assert "repetition" not in warn("x", [7, 8, 7, 8, 7, 8])


def test_repetition_is_a_share_of_repeated_ngrams_in_the_whole_or_its_second_half() -> None:
    """The rule as its docstring states it, over random outputs (some ending in loops): a run of TOKEN_RUN, or,
    in the whole output or its second half when it has MIN_REPETITION_TOKENS tokens, a share of repeated 2-, 3-
    or 4-grams of REPEATED_NGRAM_SHARE or more."""
    def stated(tokens: list[int]) -> bool:
        runs = [len(list(run)) for _, run in itertools.groupby(tokens)]
        spans = [span for span in (tokens, tokens[len(tokens) // 2:]) if len(span) >= MIN_REPETITION_TOKENS]
        grams = [[tuple(span[i:i + n]) for i in range(len(span) - n + 1)] for span in spans for n in NGRAM_SIZES]
        return (max(runs, default=0) >= TOKEN_RUN
                or any(g and 1 - len(set(g)) / len(g) >= REPEATED_NGRAM_SHARE for g in grams))

    rng = random.Random(11)
    outputs = []
    for _ in range(4000):
        tokens = [rng.randrange(rng.choice([2, 3, 6, 50])) for _ in range(rng.randrange(40))]
        if tokens and rng.random() < 0.3:
            tokens += tokens[-rng.randrange(1, 5):] * rng.randrange(1, 6)
        outputs.append(tokens)
    said = [("repetition" in warn("x", tokens)) for tokens in outputs]
    assert said == [stated(tokens) for tokens in outputs]
    assert 0.1 < sum(said) / len(said) < 0.9  # both answers are exercised


@pytest.mark.parametrize(("source", "output", "tgt_lang", "flagged"), [
    ("The weather is lovely today.", "Beau.", "fra_Latn", True),  # content dropped
    ("The weather is lovely today.", "", "fra_Latn", True),
    ("The weather is lovely today.", "Il fait beau " * 12, "fra_Latn", True),  # runs on
    ("The weather is lovely today.", "今天天气很好。", "zho_Hans", False),  # Han is dense
    ("The weather is lovely today and we are going for a long walk.", "好。", "zho_Hans", True),
    ("今天天气很好。", "The weather is lovely today.", "eng_Latn", False),
    ("Hi.", "", "fra_Latn", False),  # too short a source to judge
])
def test_length_ratio_band_depends_on_the_scripts(source: str, output: str, tgt_lang: str, flagged: bool) -> None:
    src_lang = "zho_Hans" if source.startswith("今") else "eng_Latn"
    assert ("length_ratio" in warn(output, source=source, src_lang=src_lang, tgt_lang=tgt_lang)) is flagged


@pytest.mark.parametrize(("output", "tgt_lang", "flagged"), [
    ("The weather is lovely today and we are going for a long walk.", "fra_Latn", True),  # untranslated
    ("Il fait très beau aujourd'hui et nous allons nous promener.", "fra_Latn", False),
    ("Danas je lepo vreme i idemo u dugu šetnju.", "srp_Cyrl", True),  # NLLB's Serbian is Cyrillic
    ("Погода сегодня прекрасная, и мы идём гулять.", "rus_Cyrl", False),
    ("Погода сегодня прекрасная, и мы идём гулять.", "fra_Latn", True),
    ("今日はとても良い天気です。", "jpn_Jpan", False),
    ("Danas je lijepo vrijeme i idemo u dugu šetnju.", "bos_Latn", False),  # a close neighbour
    ("The weather is lovely today and we are going for a long walk.", "fur_Latn", False),  # not covered
    ("Hello", "rus_Cyrl", False),  # too short to judge
])
def test_off_target_by_script_or_a_sure_identifier(output: str, tgt_lang: str, flagged: bool) -> None:
    assert ("off_target" in warn(output, tgt_lang=tgt_lang)) is flagged


def test_truncated_is_passed_through_and_codes_come_in_order() -> None:
    found = warn("The weather " * 10, [5, 6] * 10, tgt_lang="rus_Cyrl", truncated=True)
    assert found == [c for c in WARNING_CODES if c in found] and "truncated" in found
    assert set(found) == set(WARNING_CODES)
