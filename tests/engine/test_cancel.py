"""Cancellation: a queued job leaves the admission queue, a running one frees its rows at the next step,
nothing is left behind, and the engine serves on."""
from __future__ import annotations

import gc
import random
import time
from concurrent.futures import wait

import pytest

from engine import Engine
from engine.errors import Cancelled
from engine.jobs import Job, Segment
from engine.options import JobFuture
from tests.fixtures.make_toy import sample_sentence


def long_document(seed: int, sentences: int) -> str:
    rng = random.Random(seed)
    return "\n".join(f"{sample_sentence(rng)}." for _ in range(sentences))


def wait_for(condition, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


@pytest.fixture
def small_engine(toy_dir):
    eng = Engine.load(toy_dir, device="cpu", max_rows=8)
    yield eng
    eng.close()


def test_cancelled_running_document_frees_its_rows_at_the_next_step(small_engine):
    eng = small_engine
    future = eng.submit_document(long_document(1, 300), "eng_Latn", "fra_Latn", job_id="doc-1")
    wait_for(lambda: eng.stats().rows_used == eng.rows_total)
    steps_at = {}
    future.add_done_callback(lambda _: steps_at.setdefault("done", eng.selector.steps))
    steps_at["cancel"] = eng.selector.steps
    assert eng.cancel("doc-1")
    with pytest.raises(Cancelled) as info:
        future.result(5)
    assert (info.value.code, info.value.retryable) == ("cancelled", False)
    assert steps_at["done"] - steps_at["cancel"] <= 1  # the step in flight at most, then the rows were free
    wait_for(lambda: eng.stats().cancelled_jobs == 1)
    stats = eng.stats()
    assert stats.rows_freed_by_cancel == eng.rows_total and stats.rows_used == 0
    assert (stats.jobs_running, stats.jobs_waiting) == (0, 0)
    assert eng.table.is_empty and eng.scheduler.idle
    assert eng.translate(["rema sila"], "eng_Latn", "fra_Latn")[0].tokens  # the next job is served
    assert not eng.cancel("doc-1")  # finished: nothing to cancel


def test_cancelled_queued_job_never_takes_rows_and_the_others_finish(toy_dir):
    eng = Engine.load(toy_dir, device="cpu", max_rows=1)
    try:
        blockers = [eng.submit(["rema sila to ka"], "eng_Latn", "fra_Latn") for _ in range(5)]
        victim = eng.submit(["rema"], "eng_Latn", "fra_Latn", job_id="victim")
        assert eng.cancel("victim")
        with pytest.raises(Cancelled):
            victim.result(30)
        assert victim.started_at is None
        wait(blockers, timeout=60)
        assert all(f.result() for f in blockers)
        wait_for(lambda: eng.stats().cancelled_jobs == 1)
        assert eng.stats().rows_freed_by_cancel == 0
        assert eng.table.is_empty and eng.scheduler.idle
    finally:
        eng.close()


def test_future_cancel_of_a_running_job_raises_cancelled_and_frees_the_table(small_engine):
    eng = small_engine
    future = eng.submit([sample_sentence(random.Random(i)) for i in range(40)], "eng_Latn", "deu_Latn")
    wait_for(lambda: future.started_at is not None)
    assert future.cancel()
    with pytest.raises(Cancelled):
        future.result(5)
    assert not future.cancel()  # already over
    wait_for(lambda: eng.scheduler.idle)
    assert eng.table.is_empty


def test_cancel_of_an_unknown_id_does_nothing(small_engine):
    eng = small_engine
    running = eng.submit_document(long_document(2, 40), "eng_Latn", "fra_Latn", job_id="known")
    assert not eng.cancel("unknown")
    assert len(running.result(60).segments) == 40
    assert eng.stats().cancelled_jobs == 0


def test_cancel_reaches_every_unfinished_job_of_an_id(small_engine):
    eng = small_engine
    twins = [eng.submit_document(long_document(3, 60), "eng_Latn", "fra_Latn", job_id="twin") for _ in range(2)]
    assert eng.cancel("twin")
    for future in twins:
        with pytest.raises(Cancelled):
            future.result(10)
    wait_for(lambda: eng.scheduler.idle)
    assert eng.table.is_empty


def test_settled_jobs_are_freed_without_the_cyclic_collector(small_engine):
    """Finished, cancelled and closed-out jobs leave no reference cycle: the collector's passes grow with every
    object in flight, and a job's objects would otherwise wait for one."""
    eng = small_engine
    gc.collect()
    gc.disable()
    try:
        done = [eng.submit(["rema sila", "to ka"], "eng_Latn", "fra_Latn", job_id="a"),
                eng.submit_document(long_document(4, 12), "eng_Latn", "fra_Latn")]
        cancelled = eng.submit_document(long_document(5, 200), "eng_Latn", "fra_Latn", job_id="b")
        wait_for(lambda: eng.stats().rows_used > 0)
        assert eng.cancel("b")
        with pytest.raises(Cancelled):
            cancelled.result(10)
        for future in done:
            future.result(60)
        wait_for(lambda: eng.scheduler.idle)
        del done, cancelled, future
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        leaked = sorted({type(o).__name__ for o in gc.garbage if isinstance(o, (Job, Segment, JobFuture))})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert leaked == []
