"""The engine gives HF `generate`'s tokens and scores on the toy checkpoint, whatever shares the step."""
from __future__ import annotations

import random

import pytest

from engine import GenerationOptions
from tests.engine.hf_oracle import hf_generate
from tests.fixtures.make_toy import sample_sentence

SOURCES = ["eng_Latn", "fra_Latn", "deu_Latn", "spa_Latn", "zho_Hans"]
TARGETS = ["fra_Latn", "deu_Latn", "spa_Latn"]


def option_sweep(rng: random.Random) -> list[GenerationOptions]:
    """Every option, alone and combined: greedy, beam, sampling, penalties, length limits."""
    sweep = [GenerationOptions()]
    for nb in (2, 3, 4, 5):
        for lp in (1.0, 0.6, 1.7, -0.5):
            for es in (False, True):
                sweep.append(GenerationOptions(num_beams=nb, length_penalty=lp, early_stopping=es,
                                               num_return_sequences=rng.randint(1, nb)))
    for seed in range(12):
        sweep.append(GenerationOptions(do_sample=True, seed=seed, temperature=rng.choice([0.5, 1.0, 1.5]),
                                       top_k=rng.choice([0, 5, 50]), top_p=rng.choice([1.0, 0.9, 0.5])))
    for n in (1, 2, 3):  # capped: n = 1 bans every seen token, and 199 steps of near-ties drift
        sweep.append(GenerationOptions(no_repeat_ngram_size=n, max_new_tokens=40))
        sweep.append(GenerationOptions(num_beams=3, no_repeat_ngram_size=n, max_new_tokens=40))
    for penalty in (0.7, 1.3, 2.0):
        sweep.append(GenerationOptions(repetition_penalty=penalty))
        sweep.append(GenerationOptions(num_beams=4, repetition_penalty=penalty, num_return_sequences=2))
        sweep.append(GenerationOptions(do_sample=True, seed=100 + int(penalty * 10), repetition_penalty=penalty))
    for min_new, max_new in ((0, 1), (0, 3), (5, 8), (12, 20), (3, None)):
        sweep.append(GenerationOptions(min_new_tokens=min_new, max_new_tokens=max_new))
        sweep.append(GenerationOptions(num_beams=3, min_new_tokens=min_new, max_new_tokens=max_new))
    return sweep


def make_cases(n: int) -> list[tuple[str, str, str, GenerationOptions]]:
    rng = random.Random(1234)
    sweep = option_sweep(rng)
    cases = []
    for i in range(n):
        opts = sweep[i % len(sweep)]
        cases.append((sample_sentence(rng), rng.choice(SOURCES), rng.choice(TARGETS), opts))
    return cases


CASES = make_cases(220)


@pytest.fixture(scope="module")
def engine_results(toy_engine):
    """All cases submitted at once, so they join each other's steps in the slot table."""
    futures = [toy_engine.submit([text], src, tgt, opts) for text, src, tgt, opts in CASES]
    return [f.result(timeout=300)[0] for f in futures]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_tokens_and_scores_equal_hf_generate(case, engine_results, toy_engine, hf_toy):
    text, src, tgt, opts = CASES[case]
    tok = toy_engine.tokenizer
    got = engine_results[case]
    want = hf_generate(hf_toy, tok.encode_source(text, src), tok.lang_id(tgt), opts)
    got_tokens = [h.tokens for h in got.hypotheses] if got.hypotheses else [got.tokens]
    assert got_tokens == want.tokens
    if want.scores is not None:
        got_scores = [h.score for h in got.hypotheses] if got.hypotheses else [got.score]
        assert got_scores == pytest.approx(want.scores, abs=1e-4)


def test_text_is_sentencepiece_decoding_of_the_tokens(engine_results, toy_engine):
    sp = toy_engine.tokenizer._sp  # the sentencepiece processor itself is the oracle here
    offset = toy_engine.tokenizer.lang_offset
    for result in engine_results:
        assert result.text == sp.decode([t - 1 for t in result.tokens if 4 <= t < offset])


def test_sweep_exercises_every_mode(engine_results):
    assert any(r.hypotheses for r in engine_results)  # num_return_sequences > 1 came back
    assert len({tuple(r.tokens) for r in engine_results}) > 100  # outputs depend on the input
