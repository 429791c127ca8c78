"""Continuous batching behaviour: batch independence, admission under pressure, bad input."""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import wait
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine import Engine, GenerationOptions
from engine.errors import (DeadlineExceeded, EngineFailure, InvalidRequest, TooLong, UnknownAdapter,
                           UnknownLanguage)
from engine.step_loop import StepLoop
from engine.step_inputs import POOL_TOKEN, SRC_ADAPTER, SRC_ID, SRC_POSITION, RowInputs, StepInputs, prefill_inputs
from tests.fixtures.make_toy import sample_sentence

BEAM = GenerationOptions(num_beams=4, num_return_sequences=2)
DEVICE_MADE = [GenerationOptions(), GenerationOptions(min_new_tokens=12, max_new_tokens=12),
               GenerationOptions(repetition_penalty=1.4, no_repeat_ngram_size=2), BEAM,
               GenerationOptions(num_beams=3, length_penalty=0.6, no_repeat_ngram_size=3, min_new_tokens=5)]


def test_job_alone_and_inside_a_full_table_give_the_same_tokens(engine):
    rng = random.Random(7)
    probe = [sample_sentence(rng) for _ in range(3)]
    alone_greedy = engine.translate(probe, "eng_Latn", "deu_Latn")
    alone_beam = engine.translate(probe, "eng_Latn", "fra_Latn", BEAM)
    crowd = [engine.submit([sample_sentence(rng) for _ in range(4)], "eng_Latn", rng.choice(["fra_Latn", "spa_Latn"]),
                           rng.choice([GenerationOptions(), BEAM, GenerationOptions(do_sample=True, seed=1)]))
             for _ in range(20)]
    in_crowd_greedy = engine.submit(probe, "eng_Latn", "deu_Latn")
    in_crowd_beam = engine.submit(probe, "eng_Latn", "fra_Latn", BEAM)
    assert engine.stats().rows_used > 0 or engine.stats().jobs_waiting > 0  # the table really was busy
    assert [r.tokens for r in in_crowd_greedy.result(60)] == [r.tokens for r in alone_greedy]
    assert [[h.tokens for h in r.hypotheses] for r in in_crowd_beam.result(60)] == \
           [[h.tokens for h in r.hypotheses] for r in alone_beam]
    wait(crowd, timeout=120)


def test_mixed_modes_share_a_batch_with_each_modes_logits_rows_one_slice(toy_dir, monkeypatch):
    """Greedy, sampled and two beam widths arriving interleaved: the step loop orders a batch by mode, so each plan's
    greedy and beam groups read a slice of the logits (no copy), and every job gets the tokens it gets alone."""
    from engine import plan
    plans = []
    build = plan.build
    monkeypatch.setattr("engine.selection.build", lambda *a: plans.append(build(*a)) or plans[-1])
    modes = [GenerationOptions(), GenerationOptions(num_beams=4, max_new_tokens=9), GenerationOptions(do_sample=True,
             seed=3), GenerationOptions(num_beams=3, no_repeat_ngram_size=2), GenerationOptions(repetition_penalty=1.3)]
    texts = [sample_sentence(random.Random(i)) for i in range(15)]
    eng = Engine.load(toy_dir, device="cpu", max_rows=48, max_rows_per_job=48)
    try:
        crowd = [eng.submit([t], "eng_Latn", "fra_Latn", modes[i % len(modes)]) for i, t in enumerate(texts)]
        together = [f.result(60)[0].tokens for f in crowd]
        alone = [eng.translate([t], "eng_Latn", "fra_Latn", modes[i % len(modes)])[0].tokens
                 for i, t in enumerate(texts)]
    finally:
        eng.close()
    assert together == alone
    mixed = [p for p in plans if p.greedy.rows and p.beams]
    assert mixed, "no plan held greedy and beam segments together"
    for p in plans:
        assert all(group.first >= 0 for group in p.groups() if group.rows)


def _crowd_beside_a_failed_newcomer(toy_dir, fail_it_after_its_batch: bool) -> None:
    """Greedy and beam crowds decoding, and a greedy newcomer (between them in the batch: segments by mode, then
    arrival) whose job fails in its first step: while that step is in flight (before the next step's batch), or
    after its batch was made and before its selection. A device-made step must hold the failed segment's rows,
    and every other job get the tokens it gets alone."""
    texts = [sample_sentence(random.Random(i)) for i in range(20)]
    long = GenerationOptions(min_new_tokens=14, max_new_tokens=14)
    beams = GenerationOptions(num_beams=2, min_new_tokens=14, max_new_tokens=14)
    eng = Engine.load(toy_dir, device="cpu", max_rows=32, max_rows_per_job=32)
    try:
        alone = [r.tokens for r in eng.translate(texts[:12], "eng_Latn", "fra_Latn", long)]
        alone_beams = [r.tokens for r in eng.translate(texts[12:], "eng_Latn", "fra_Latn", beams)]
        doomed, device_made = [], []
        expire, execute, on_device = eng.scheduler.expire, eng.loop._execute, eng.loop._batch_on_device

        def fail_the_newcomer(segments: list) -> None:
            if not doomed and any(seg.search.cur_len >= 3 for seg in segments):  # the crowd decodes: a newcomer
                doomed.append(eng.submit(["ta lidor"], "eng_Latn", "fra_Latn", long))
            for seg in segments:
                if doomed and seg.job.future is doomed[0] and seg.search.cur_len == 1 and seg.rows:
                    eng.scheduler.fail(seg.job, EngineFailure("failed in its first step"))

        def before_the_next_batch() -> None:  # where a passed deadline is failed
            f = eng.loop.in_flight
            fail_the_newcomer(f.batch.segments if f is not None else [])
            expire()

        def after_its_batch(batch):
            logits = execute(batch)
            fail_the_newcomer(batch.segments)
            return logits

        def counted():
            batch = on_device()
            device_made.append(batch is not None and any(seg.job.failed for seg in batch.segments))
            return batch
        if fail_it_after_its_batch:
            eng.loop._execute = after_its_batch
        else:
            eng.scheduler.expire = before_the_next_batch
        eng.loop._batch_on_device = counted
        crowd = eng.submit(texts[:12], "eng_Latn", "fra_Latn", long)
        crowd_beams = eng.submit(texts[12:], "eng_Latn", "fra_Latn", beams)
        together = [r.tokens for r in crowd.result(60)]
        together_beams = [r.tokens for r in crowd_beams.result(60)]
        with pytest.raises(EngineFailure):
            doomed[0].result(10)
    finally:
        eng.close()
    assert any(device_made), "no device-made step held the failed segment"
    assert together == alone and together_beams == alone_beams


def test_a_segment_failed_during_its_first_step_leaves_the_next_device_made_steps_logits_to_the_others(toy_dir):
    """The next step, made on the device from the failed segment's first, gives its rows logits too: the plan must
    count them, or every segment after it in the batch reads another's logits."""
    _crowd_beside_a_failed_newcomer(toy_dir, fail_it_after_its_batch=False)


def test_a_segment_that_leaves_between_its_batch_and_its_first_selection_leaves_the_later_steps_to_the_others(
        toy_dir):
    """As when another segment of its job fails while the step in flight settles: the plan, made without it, holds
    for the next steps, made on the device, where its rows compute on; every other segment reads its own rows."""
    _crowd_beside_a_failed_newcomer(toy_dir, fail_it_after_its_batch=True)


def test_newcomers_of_every_mode_leave_each_modes_logits_rows_one_slice(toy_dir, monkeypatch):
    """Jobs of every mode arriving while others decode: the admission step's batch holds rows at their first step
    (no logits read) among the others' rows; each mode's rows are still one slice of the step's logits, and every
    job gets the tokens it gets alone."""
    from engine import plan
    plans = []
    build = plan.build
    monkeypatch.setattr("engine.selection.build", lambda *a: plans.append(build(*a)) or plans[-1])
    modes = [GenerationOptions(max_new_tokens=12), GenerationOptions(num_beams=3, max_new_tokens=12),
             GenerationOptions(do_sample=True, seed=5, max_new_tokens=12)]
    texts = [sample_sentence(random.Random(40 + i)) for i in range(12)]
    eng = Engine.load(toy_dir, device="cpu", max_rows=64, max_rows_per_job=64)
    try:
        alone = [eng.translate([t], "eng_Latn", "fra_Latn", modes[i % 3])[0].tokens for i, t in enumerate(texts)]
        plans.clear()
        execute, late = eng.loop._execute, []

        def newcomers_while_the_first_decode(batch):
            if not late and any(seg.search.cur_len >= 3 for seg in batch.segments):
                late.extend(eng.submit([t], "eng_Latn", "fra_Latn", modes[i % 3]) for i, t in enumerate(texts)
                            if i >= 6)
            return execute(batch)
        eng.loop._execute = newcomers_while_the_first_decode
        early = [eng.submit([t], "eng_Latn", "fra_Latn", modes[i % 3]) for i, t in enumerate(texts[:6])]
        together = [f.result(60)[0].tokens for f in early] + [f.result(60)[0].tokens for f in late]
    finally:
        eng.close()
    assert together == alone
    admitting = [p for p in plans if p.forced and (p.greedy.rows or p.beams)]
    assert admitting, "no plan held newcomers beside decoding segments"
    for p in plans:
        assert all(group.first >= 0 for group in p.groups() if group.rows)


def test_steps_made_on_the_device_give_the_tokens_of_steps_made_on_the_host(toy_dir, monkeypatch):
    """Greedy and beam batches start the next step from the picks and beam steps on the device, before the
    host reads them (StepLoop._batch_on_device); tokens and scores must be those of batches made from the
    host tables, with the </s> ban of min_new_tokens and history processors too."""
    texts = [sample_sentence(random.Random(i)) for i in range(6)]
    made = {"device": 0, "host": 0}
    speculate = StepLoop._batch_on_device

    def counted(self):
        batch = speculate(self)
        made["host" if batch is None else "device"] += 1
        return batch
    monkeypatch.setattr(StepLoop, "_batch_on_device", counted)
    eng = Engine.load(toy_dir, device="cpu", max_rows=8)
    try:
        speculated = [eng.translate(texts, "eng_Latn", "fra_Latn", opts) for opts in DEVICE_MADE]
        device_made = made["device"]
        monkeypatch.setattr(StepLoop, "_batch_on_device", lambda self: None)
        from_host = [eng.translate(texts, "eng_Latn", "fra_Latn", opts) for opts in DEVICE_MADE]
    finally:
        eng.close()
    assert device_made > 0 and made["host"] > 0  # the first steps (forced token, admission) come from the host
    assert [[(r.tokens, r.score, [(h.tokens, h.score) for h in r.hypotheses]) for r in rs] for rs in speculated] == \
           [[(r.tokens, r.score, [(h.tokens, h.score) for h in r.hypotheses]) for r in rs] for rs in from_host]


def test_a_batch_whose_rows_all_reach_max_length_is_read_before_another_step_is_launched(toy_dir, monkeypatch):
    """A fixed-length batch (min_new_tokens = max_new_tokens = 9: the decoder fed at positions 0..8) runs its 9
    steps and no tenth, whose rows would all be dropped: greedy, sampled and beam. Where one job runs on, the
    other's rows compute with it until the longest ends."""
    texts = [sample_sentence(random.Random(i)) for i in range(5)]
    executed = {"steps": 0}
    execute = StepLoop._execute

    def counted(self, batch):
        executed["steps"] += 1
        return execute(self, batch)
    monkeypatch.setattr(StepLoop, "_execute", counted)
    fixed = dict(min_new_tokens=9, max_new_tokens=9)
    eng = Engine.load(toy_dir, device="cpu", max_rows=64)  # every job's segments at once, beams included
    try:
        for opts in (GenerationOptions(**fixed), GenerationOptions(do_sample=True, seed=3, **fixed),
                     GenerationOptions(num_beams=3, **fixed)):
            executed["steps"] = 0
            out = eng.translate(texts, "eng_Latn", "fra_Latn", opts)
            assert executed["steps"] == 9, opts
            assert [len(r.tokens) for r in out] == [8] * len(texts)  # the language token, then 8
        executed["steps"] = 0
        short = GenerationOptions(min_new_tokens=4, max_new_tokens=4)
        both = [eng.submit(texts[:2], "eng_Latn", "fra_Latn", o) for o in (short, GenerationOptions(**fixed))]
        assert [len(r.tokens) for f in both for r in f.result(60)] == [3, 3, 8, 8]
        assert executed["steps"] in (9, 10)  # 10: the second job came a step after the first
    finally:
        eng.close()


def test_ragged_traffic_keeps_device_made_steps_through_departures_and_gives_each_jobs_own_tokens(toy_dir,
                                                                                                  monkeypatch):
    """Jobs of their own lengths, more than the rows: segments leave at nearly every step. The device goes on
    making steps over the rows of segments that left (their picks dropped) and admission waits for a batch of
    free rows; every job's tokens must still be those of the job decoded alone on host-made steps."""
    rng = random.Random(11)
    jobs = [(sample_sentence(rng), rng.choice([GenerationOptions(min_new_tokens=n, max_new_tokens=n)] * 3 + [
                GenerationOptions(min_new_tokens=n // 2, max_new_tokens=n),
                GenerationOptions(num_beams=2, min_new_tokens=n, max_new_tokens=n)]))
            for n in (rng.randint(8, 30) for _ in range(240))]
    over_departures = {"steps": 0}
    made_on_device = StepLoop._batch_on_device

    def counted(self):
        batch = made_on_device(self)
        if batch is not None and batch.live.size > self.table.rows_used:
            over_departures["steps"] += 1
        return batch
    monkeypatch.setattr(StepLoop, "_batch_on_device", counted)
    eng = Engine.load(toy_dir, device="cpu", max_rows=128)
    try:
        futures = [eng.submit([text], "eng_Latn", "fra_Latn", opts) for text, opts in jobs]
        ragged = [f.result(120)[0] for f in futures]
        monkeypatch.setattr(StepLoop, "_batch_on_device", lambda self: None)
        alone = [eng.translate([text], "eng_Latn", "fra_Latn", opts)[0] for text, opts in jobs]
    finally:
        eng.close()
    assert over_departures["steps"] > 10
    assert [(r.tokens, [h.tokens for h in r.hypotheses]) for r in ragged] == \
           [(r.tokens, [h.tokens for h in r.hypotheses]) for r in alone]
    # scores to float32 rounding: the CPU's matmuls round differently at other batch widths
    assert [r.score for r in ragged] == pytest.approx([r.score for r in alone], rel=1e-5)


def test_same_seed_samples_the_same_whatever_shares_the_batch(engine):
    opts = GenerationOptions(do_sample=True, seed=42, temperature=1.3)
    alone = engine.translate(["tokala mesu ri"], "eng_Latn", "fra_Latn", opts)[0].tokens
    others = [engine.submit(["rema sila to"], "eng_Latn", "deu_Latn", GenerationOptions(do_sample=True, seed=s))
              for s in range(10)]
    again = engine.submit(["tokala mesu ri"], "eng_Latn", "fra_Latn", opts)
    assert again.result(60)[0].tokens == alone
    wait(others, timeout=60)


def test_warm_up_without_cuda_graphs_captures_nothing_and_the_engine_serves(engine):
    assert engine.warm_up(rows=8, src_tokens=20) == 0  # the CPU path has no graphs: nothing to capture
    assert engine.translate(["rema sila"], "eng_Latn", "fra_Latn")[0].text


def test_prefill_inputs_pack_each_source_with_its_positions_pool_entries_and_adapter():
    segments = [SimpleNamespace(src_ids=[5, 6, 7], src_start=10, adapter_slot=2),
                SimpleNamespace(src_ids=[8], src_start=0, adapter_slot=0),
                SimpleNamespace(src_ids=[9, 4], src_start=3, adapter_slot=1)]
    tokens, cu_seqlens = prefill_inputs(segments)
    assert cu_seqlens.tolist() == [0, 3, 4, 6]
    assert tokens[SRC_ID].tolist() == [5, 6, 7, 8, 9, 4]
    assert tokens[SRC_POSITION].tolist() == [0, 1, 2, 0, 0, 1]
    assert tokens[POOL_TOKEN].tolist() == [10, 11, 12, 0, 3, 4]
    assert tokens[SRC_ADAPTER].tolist() == [2, 2, 2, 0, 1, 1]


def test_step_inputs_are_named_views_of_one_buffer_that_gathers_and_moves_as_one():
    inputs = StepInputs(5)
    def search(tokens: list[int], code: int, min_new: int) -> SimpleNamespace:
        return SimpleNamespace(next_tokens=lambda: tokens, plan_code=code,
                               ctx=SimpleNamespace(max_length=3, options=SimpleNamespace(min_new_tokens=min_new)))
    beam = SimpleNamespace(rows=[3, 1], search=search([7, 8], 2 << 2, 5), src_start=40, src_ids=[1, 2, 3],
                           adapter_slot=2)
    single = SimpleNamespace(rows=[4], search=search([6], 1 << 2 | 2, 0), src_start=0, src_ids=[5], adapter_slot=0)
    assert inputs.admit([beam, single]).tolist() == [3, 1, 4]
    # what a selection plan reads of each row's segment: its code, min_new_tokens, the row's place in the segment
    modes = inputs.modes
    assert (modes.code[[3, 1, 4]].tolist(), modes.min_new[[3, 1, 4]].tolist(), modes.lane[[3, 1, 4]].tolist()) == \
           ([8, 8, 6], [5, 5, 0], [0, 1, 0])
    inputs.advance(np.array([3]))
    live = inputs.gather(np.array([3, 1, 4]))
    assert (live.token.tolist(), live.position.tolist(), live.row.tolist()) == ([7, 8, 6], [1, 0, 0], [3, 1, 4])
    # a step at position p makes a sequence p + 2 long: of max_length 3, row 3 (at 1) ends with it, row 4 (at 0) next
    assert inputs.steps_left(np.array([3]), live.position[:1]) == 0
    assert inputs.steps_left(np.array([3, 4]), live.position[[0, 2]]) == 1
    assert (live.src_start.tolist(), live.src_len.tolist(), live.adapter.tolist()) == ([40, 40, 0], [3, 3, 1],
                                                                                       [2, 2, 0])
    inputs.tokens[1] = 9  # selection writes the next tokens through the table's view
    assert inputs.table.buffer[0, 1] == 9 and live.token[1] == 8  # a gather is a copy
    filler = RowInputs.filled(3, torch.device("cpu"), token=1, position=0, row=5, src_start=0, src_len=1, adapter=0)
    assert filler.buffer.shape == (6, 3) and filler.row.tolist() == [5, 5, 5]
    head = filler.columns(slice(0, 2))
    head.position.add_(4)  # a slice is a view: what a captured graph reads
    assert filler.position.tolist() == [4, 4, 0]


def test_engine_thread_tasks_return_raise_and_fail_once_the_engine_is_closed(toy_dir):
    eng = Engine.load(toy_dir, device="cpu", max_rows=8)
    try:
        assert eng._on_engine_thread(lambda: threading.current_thread().name) == "nllb-engine"
        with pytest.raises(ZeroDivisionError):
            eng._on_engine_thread(lambda: 1 / 0)
        assert eng.translate(["rema sila"], "eng_Latn", "fra_Latn")[0].text  # still serving
    finally:
        eng.close()
    with pytest.raises(EngineFailure):
        eng._on_engine_thread(lambda: None)


def test_posted_work_runs_on_the_engine_thread_in_order_and_a_failure_leaves_it_serving(toy_dir, caplog):
    eng = Engine.load(toy_dir, device="cpu", max_rows=8)
    ran: list[tuple[str, object]] = []
    try:
        futures = []

        def submit_two() -> None:  # its jobs join the inbox behind it and run like any other
            ran.append((threading.current_thread().name, "submit"))
            futures.extend(eng.submit([text], "eng_Latn", "fra_Latn") for text in ("rema sila", "sila"))

        eng.post(submit_two)
        eng.post(lambda: 1 / 0)
        done = eng._on_engine_thread(lambda: ran.append((threading.current_thread().name, "after")))
        assert done is None and ran == [("nllb-engine", "submit"), ("nllb-engine", "after")]
        assert [f.result(30)[0].text for f in futures] == \
            [t.text for t in eng.translate(["rema sila", "sila"], "eng_Latn", "fra_Latn")]
        assert "a task posted to the engine thread failed" in caplog.text
    finally:
        eng.close()
    refused: list[BaseException] = []

    def submit_late() -> None:
        try:
            eng.submit(["rema"], "eng_Latn", "fra_Latn")
        except EngineFailure as e:
            refused.append(e)
    eng.post(submit_late)  # a closed engine runs it at once, and refuses the job
    assert len(refused) == 1


def test_more_jobs_than_rows_wait_and_all_finish(toy_dir):
    eng = Engine.load(toy_dir, device="cpu", max_rows=4)
    try:
        rng = random.Random(3)
        futures = [eng.submit([sample_sentence(rng)], "eng_Latn", "fra_Latn",
                              BEAM if i % 3 == 0 else GenerationOptions()) for i in range(40)]
        peak = 0
        while not all(f.done() for f in futures):
            peak = max(peak, eng.stats().rows_used)
            time.sleep(0.002)
        assert all(len(f.result()) == 1 for f in futures)
        assert peak <= 4
        assert eng.table.is_empty and eng.scheduler.idle
    finally:
        eng.close()


def eng_ids(eng: Engine, *pieces: int) -> list[int]:
    """A token-ids source: `[eng_Latn] pieces </s>`."""
    return [eng.tokenizer.lang_id("eng_Latn"), *pieces, eng.tokenizer.eos_id]


@pytest.mark.parametrize("call, error", [
    (lambda e: e.submit(["hello"], "eng_Latn", "xx_Latn"), UnknownLanguage),
    (lambda e: e.submit(["hello"], "english", "fra_Latn"), UnknownLanguage),
    (lambda e: e.submit(["hello", "  "], "eng_Latn", "fra_Latn"), InvalidRequest),
    (lambda e: e.submit([], "eng_Latn", "fra_Latn"), InvalidRequest),
    (lambda e: e.submit(["ta " * 2000], "eng_Latn", "fra_Latn"), TooLong),
    (lambda e: e.submit_ids([], "fra_Latn"), InvalidRequest),  # no source: answered, not a future left pending
    (lambda e: e.submit_ids([eng_ids(e, 60), []], "fra_Latn"), InvalidRequest),
    (lambda e: e.submit_ids([eng_ids(e, 60), eng_ids(e, -1)], "fra_Latn"), InvalidRequest),
    (lambda e: e.submit_ids([eng_ids(e, 60), eng_ids(e, e.cfg.vocab_size)], "fra_Latn"), InvalidRequest),
    (lambda e: e.submit_ids([eng_ids(e, 60), eng_ids(e, *[60] * 5000)], "fra_Latn"), TooLong),
    (lambda e: e.submit_ids([eng_ids(e, 60), eng_ids(e, "60")], "fra_Latn"), InvalidRequest),
    (lambda e: e.submit_ids([eng_ids(e, [60])], "fra_Latn"), InvalidRequest),
    (lambda e: e.submit_ids([eng_ids(e, 60), eng_ids(e, 60.5)], "fra_Latn"), InvalidRequest),
    (lambda e: e.submit_ids(eng_ids(e, 60), "fra_Latn"), InvalidRequest),  # one source, not a batch of them
    (lambda e: e.submit_ids(["hello"], "fra_Latn"), InvalidRequest),
    (lambda e: e.submit_ids(7, "fra_Latn"), InvalidRequest),
    (lambda e: e.submit(["hello"], "eng_Latn", "fra_Latn", adapter="legal-fr"), UnknownAdapter),
    (lambda e: e.submit(["hello"], "eng_Latn", "fra_Latn", GenerationOptions(max_new_tokens=100_0)), InvalidRequest),
    (lambda e: e.submit(["hello"], "eng_Latn", "fra_Latn", GenerationOptions(num_beams=4000 // 64)), InvalidRequest),
])
def test_bad_input_is_a_typed_error_and_the_engine_keeps_serving(engine, call, error):
    with pytest.raises(error) as info:
        call(engine)
    assert str(info.value)  # says what was wrong
    assert engine.translate(["rema sila"], "eng_Latn", "fra_Latn")[0].tokens


def test_token_ids_as_numpy_rows_decode_as_the_same_lists_do(engine):
    rng = np.random.default_rng(3)
    batch = [eng_ids(engine, *rng.integers(4, 300, size=n).tolist()) for n in (3, 7, 7)]
    opts = GenerationOptions(max_new_tokens=6)
    want = [t.tokens for t in engine.generate(batch, "fra_Latn", opts)]
    assert [t.tokens for t in engine.generate([np.array(ids) for ids in batch], "fra_Latn", opts)] == want
    assert [t.tokens for t in engine.generate(np.array(batch[1:]), "fra_Latn", opts)] == want[1:]


@pytest.mark.parametrize("fields", [
    dict(num_beams=0), dict(temperature=0.0), dict(top_p=1.5), dict(top_k=-1), dict(repetition_penalty=0),
    dict(num_return_sequences=3, num_beams=2), dict(min_new_tokens=5, max_new_tokens=2), dict(max_new_tokens=0),
    dict(length_penalty=float("nan")), dict(num_beams=2, do_sample=True), dict(seed=-1), dict(num_beams=True),
])
def test_invalid_option_values_are_refused_with_the_field_named(fields):
    with pytest.raises(InvalidRequest) as info:
        GenerationOptions(**fields)
    assert any(name in str(info.value) for name in fields)


def test_error_messages_name_close_language_matches(engine):
    with pytest.raises(UnknownLanguage, match="fra_Latn"):
        engine.submit(["hello"], "eng_Latn", "fra_latn")


def test_expired_deadline_is_answered_deadline_exceeded(engine):
    future = engine.submit(["rema sila"], "eng_Latn", "fra_Latn", deadline=time.time() - 1)
    with pytest.raises(DeadlineExceeded):
        future.result(10)


def test_cancelled_job_is_dropped_before_it_takes_rows(toy_dir):
    eng = Engine.load(toy_dir, device="cpu", max_rows=1)
    try:
        blockers = [eng.submit(["rema sila to ka"], "eng_Latn", "fra_Latn") for _ in range(5)]
        victim = eng.submit(["rema"], "eng_Latn", "fra_Latn")
        assert victim.cancel()
        wait(blockers, timeout=60)
        assert all(f.result() for f in blockers)
        assert eng.table.is_empty
    finally:
        eng.close()


def test_close_fails_unfinished_jobs_as_retryable(toy_dir):
    eng = Engine.load(toy_dir, device="cpu", max_rows=1)
    futures = [eng.submit(["rema sila to ka"], "eng_Latn", "fra_Latn") for _ in range(30)]
    eng.close()
    outcomes = [f.exception(10) for f in futures]
    assert any(isinstance(e, EngineFailure) and e.retryable for e in outcomes)
    with pytest.raises(EngineFailure):
        eng.submit(["rema"], "eng_Latn", "fra_Latn")


def test_a_failing_step_fails_its_jobs_and_the_engine_serves_on(toy_dir, monkeypatch):
    eng = Engine.load(toy_dir, device="cpu", max_rows=8)
    try:
        real = eng.model.decode_step
        calls = {"n": 0}

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("simulated device error")
            return real(*args, **kwargs)

        monkeypatch.setattr(eng.model, "decode_step", flaky)
        doomed = eng.submit(["rema sila"], "eng_Latn", "fra_Latn")
        assert isinstance(doomed.exception(30), EngineFailure)
        assert eng.table.is_empty
        assert eng.translate(["rema sila"], "eng_Latn", "fra_Latn")[0].tokens
    finally:
        eng.close()


def test_future_tells_when_a_job_took_rows(toy_dir):
    eng = Engine.load(toy_dir, device="cpu", max_rows=1)
    try:
        submitted = time.monotonic()
        first = eng.submit(["rema sila to ka"], "eng_Latn", "fra_Latn")
        second = eng.submit(["rema"], "eng_Latn", "fra_Latn")
        first.result(30)
        first_done = time.monotonic()
        second.result(30)
        assert submitted <= first.started_at <= first_done
        assert second.started_at >= first.started_at  # it waited for the only row
    finally:
        eng.close()


def test_stats_are_safe_to_read_from_other_threads_while_the_table_churns(engine):
    import threading

    errors, seen = [], []
    stop = threading.Event()

    def poll():  # as a metrics exporter would, only a thousand times more often
        while not stop.is_set():
            try:
                seen.append(engine.stats())
            except Exception as exc:  # noqa: BLE001 - the point is that none happens
                errors.append(exc)
            time.sleep(0.001)

    poller = threading.Thread(target=poll)
    poller.start()
    rng = random.Random(5)
    futures = [engine.submit([sample_sentence(rng) for _ in range(3)], "eng_Latn", "deu_Latn") for _ in range(60)]
    wait(futures, timeout=120)
    time.sleep(0.05)  # one more snapshot after the last job
    stop.set()
    poller.join()
    assert not errors
    assert max(s.rows_used for s in seen) > 0 and max(s.jobs_running for s in seen) > 0
    final = engine.stats()
    assert (final.rows_used, final.jobs_running, final.jobs_waiting) == (0, 0, 0)
    assert final.tokens_generated > 0


def test_decode_graphs_are_planned_for_short_outputs_until_a_row_is_longer(engine):
    """A step's self-attention is planned for SHORT_TARGET positions while every row is that short, then for the
    table's capacity (a table shorter than SHORT_TARGET: its own capacity throughout)."""
    from engine.step_loop import SHORT_TARGET
    loop, capacity = engine.loop, engine.table.target_len
    assert capacity > SHORT_TARGET
    assert [loop.target_bound(n) for n in (1, SHORT_TARGET, SHORT_TARGET + 1, capacity)] == [
        SHORT_TARGET, SHORT_TARGET, capacity, capacity]
    table = engine.table
    try:
        table.target_len = 100
        assert loop.target_bound(1) == loop.target_bound(100) == 100
    finally:
        table.target_len = capacity
