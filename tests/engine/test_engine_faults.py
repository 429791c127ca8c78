"""One job's trouble stays that job's: cancels between steps, a failure while finishing a segment, a
deadline that passes during an admission, a cancel that overtakes its job's submission."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from engine import Engine, GenerationOptions
from engine import step_loop as step_loop_module
from engine import scheduler as scheduler_module
from engine.errors import Cancelled, DeadlineExceeded, EngineFailure

LONG = GenerationOptions(min_new_tokens=60, max_new_tokens=60)


@pytest.fixture
def eng(toy_dir):
    e = Engine.load(toy_dir, device="cpu", max_rows=16)
    yield e
    e.close()


def wait_idle(eng: Engine) -> None:
    end = time.monotonic() + 30
    while not (eng.table.is_empty and eng.scheduler.idle):
        assert time.monotonic() < end, "the engine kept rows or jobs"
        time.sleep(0.005)


def test_a_job_cancelled_right_after_its_admission_leaves_the_others_running(eng):
    bystander = eng.submit(["rema sila to ka"], "eng_Latn", "fra_Latn", LONG, job_id="bystander")
    admit = eng.scheduler.admit

    def admit_then_cancel():  # the cancel lands between the victim's admission and its first step's outcome
        admitted = admit()
        for seg in admitted:
            if seg.job.job_id == "victim":
                seg.job.future.cancel()
        return admitted
    eng.scheduler.admit = admit_then_cancel
    victim = eng.submit(["tokala rema"], "eng_Latn", "fra_Latn", job_id="victim")
    with pytest.raises(Cancelled):
        victim.result(30)
    assert len(bystander.result(30)[0].tokens) >= 59
    wait_idle(eng)


def test_a_job_whose_answer_fails_fails_alone(eng, monkeypatch):
    translation = step_loop_module.results.translation

    def failing(seg, found):
        if seg.job.job_id == "broken":
            raise ValueError("a bug on this job's text path")
        return translation(seg, found)
    monkeypatch.setattr(step_loop_module.results, "translation", failing)
    other = eng.submit(["rema sila to ka"], "eng_Latn", "fra_Latn", LONG, job_id="other")
    broken = eng.submit(["tokala", "rema"], "eng_Latn", "fra_Latn", job_id="broken")
    with pytest.raises(EngineFailure, match="finishing this job"):
        broken.result(30)
    assert other.result(30)[0].tokens
    assert eng.translate(["rema"], "eng_Latn", "fra_Latn")[0].tokens  # the engine goes on serving
    wait_idle(eng)


def test_a_deadline_passing_during_an_admission_drops_that_jobs_segments_before_the_encoder(eng, monkeypatch):
    may_widen = eng.scheduler._may_widen
    deadline = time.time() + 30
    clock = {"now": deadline - 1}
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(time=lambda: clock["now"], monotonic=time.monotonic))

    def deadline_passes():  # between the capped and the uncapped admission pass
        clock["now"] = deadline + 10
        return may_widen()
    eng.scheduler._may_widen = deadline_passes
    prefilled: list = []
    prefill = eng.loop._prefill
    eng.loop._prefill = lambda segments: (prefilled.extend(segments), prefill(segments))[1]
    ids = eng.tokenizer.encode_source("rema sila", "eng_Latn")
    late = eng.submit_ids([ids] * 12, "fra_Latn", deadline=deadline)
    with pytest.raises(DeadlineExceeded):
        late.result(30)
    assert all(seg.job.future is not late for seg in prefilled)  # none of its released segments was encoded
    wait_idle(eng)


def test_a_cancel_that_overtakes_its_jobs_submission_leaves_nothing_waiting(eng, monkeypatch):
    class CancelFirst:
        """The engine's inbox, but Engine.cancel runs between the id's registration and the job's arrival."""

        def __init__(self, inbox):
            self.inbox = inbox

        def put(self, item):
            if getattr(item, "job_id", None) == "raced":
                eng.cancel("raced")
                time.sleep(0.05)
            self.inbox.put(item)

        def __getattr__(self, name):
            return getattr(self.inbox, name)
    monkeypatch.setattr(eng, "_inbox", CancelFirst(eng._inbox))
    raced = eng.submit(["rema"], "eng_Latn", "fra_Latn", job_id="raced")
    with pytest.raises(Cancelled):
        raced.result(30)
    end = time.monotonic() + 10
    while eng.stats().jobs_waiting or eng._inbox.qsize():  # the job itself arrives after its cancel
        assert time.monotonic() < end, "the cancelled job stayed waiting"
        time.sleep(0.005)
    time.sleep(0.05)  # one more turn of the engine thread with the job handled
    assert not eng.scheduler.waiting and eng.stats().jobs_waiting == 0
    wait_idle(eng)


def test_a_deadline_passing_while_a_job_decodes_ends_it_there_and_the_others_run_on(eng, monkeypatch):
    """PROTOCOL: a job not finished by its deadline is answered deadline_exceeded instead of being translated,
    so the deadline holds after the job took its rows too: it fails at the next step, its rows free, while a job
    beside it without a deadline finishes as it would alone."""
    deadline = time.time() + 30
    clock = {"now": deadline - 10}
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(time=lambda: clock["now"], monotonic=time.monotonic))
    alone = eng.translate(["rema sila to ka"], "eng_Latn", "fra_Latn", LONG)[0].tokens
    tokens = eng.loop.tokens_generated
    bystander = eng.submit(["rema sila to ka"], "eng_Latn", "fra_Latn", LONG)
    late = eng.submit(["rema sila", "ka to"], "eng_Latn", "fra_Latn", LONG, deadline=deadline)
    end = time.monotonic() + 30
    while late.started_at is None or eng.loop.tokens_generated < tokens + 20:  # decoding, a few steps in
        assert time.monotonic() < end and not late.done(), "the job never started decoding"
        time.sleep(0.001)
    clock["now"] = deadline + 0.001
    with pytest.raises(DeadlineExceeded, match="before it finished"):
        late.result(30)
    assert bystander.result(30)[0].tokens == alone
    wait_idle(eng)
