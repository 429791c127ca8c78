"""bench.worker_rate's job mixes: the `stream` mix is the arrival stream's single sentences (bench/workloads.py
`make_stream`, the oracle) as texts, and a worker answers every one of them through the real broker; the engine
alone's host profile is of the engine thread."""
from __future__ import annotations

import asyncio

import pytest

from bench import worker_rate
from bench.workloads import Vocab, make_stream
from engine import TOY_MODEL_DIR
from engine.tokenizer import Tokenizer


def test_stream_mix_is_the_arrival_streams_single_sentences():
    tok = Tokenizer.load(TOY_MODEL_DIR)
    stream = make_stream(Vocab(tok), 200, rate=1.0, quick=False, single=True)
    jobs = worker_rate.rate_jobs("stream", 200, 2, None)
    assert len(jobs) == len(stream) == 200
    for job, want in zip(jobs, stream):
        source = want.segments[0]
        assert (job.src_lang, job.tgt_lang) == (tok.lang_code(source[0]), want.tgt)
        assert (job.num_beams, job.new_tokens) == (want.beams, want.new_tokens)
        assert abs(len(tok.encode_source(job.text, job.src_lang)) - len(source)) <= 8
        assert job.options == {"num_beams": want.beams, "min_new_tokens": want.new_tokens,
                               "max_new_tokens": want.new_tokens}
    assert {j.num_beams for j in jobs} == {1, 4} and {j.new_tokens for j in jobs} == {16, 32, 64, 128}


def test_fixed_mix_decodes_the_asked_tokens_greedily():
    jobs = worker_rate.rate_jobs("fixed", 7, 3, None)
    assert [j.text for j in jobs] == [worker_rate.TEXTS[i % 5] for i in range(7)]
    assert {(j.src_lang, j.tgt_lang, j.num_beams, j.new_tokens) for j in jobs} == {("eng_Latn", "fra_Latn", 1, 3)}


def test_worker_rate_answers_every_stream_job_once(broker):
    result = asyncio.run(worker_rate.measure(broker, 24, 2, mix="stream"))
    assert result["jobs"] == 24 and result["errors"] == 0 and result["duplicates"] == 0
    mean_tokens = sum(j.new_tokens for j in worker_rate.rate_jobs("stream", 24, 2, None)) / 24
    # jobs_per_s is rounded to 0.1, a few tenths of a percent at the toy's rate on this mix
    assert result["tokens_per_s"] == pytest.approx(result["jobs_per_s"] * mean_tokens, rel=1e-2)


def test_engine_only_host_profile_covers_the_engine_threads_steps(tmp_path):
    path = tmp_path / "host.txt"
    result = worker_rate.engine_rate(12, 3, None, "cpu", cpu_threads=1, mix="stream", host_profile=path)
    assert result["jobs"] == 12 and result["jobs_per_s"] > 0
    profile = path.read_text()
    # the timed pass's steps run on the engine thread: a profile of the caller's thread would hold none
    assert "step_loop.py" in profile and "(step)" in profile and "function calls" in profile
