"""Admission: first come first served, with a per-job row cap while a small job is in, else work-conserving."""
from __future__ import annotations

import random
import time
from operator import attrgetter
from types import SimpleNamespace

import pytest
import torch

from engine import Engine
from engine.config import load_config
from engine import scheduler as scheduler_module
from engine.errors import Cancelled, DeadlineExceeded
from engine.jobs import Job, Segment
from engine.options import JobFuture
from engine.scheduler import Scheduler
from engine.slots import SlotTable
from tests.fixtures.make_toy import sample_sentence


def make_job(name: str, widths: list[int]) -> Job:
    job = Job(JobFuture(), None, None, [[i] for i in range(len(widths))], attrgetter("answers"), job_id=name)
    job.segments = [Segment(job, i, [5, 6, 2], SimpleNamespace(rows=w)) for i, w in enumerate(widths)]
    return job


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def scheduler(toy_dir, clock):
    table = SlotTable(load_config(toy_dir), 8, 16, 256, torch.float32, torch.device("cpu"))
    return Scheduler(table, None, row_cap=2, widen_after_s=0.05, clock=clock)


def admitted_by(segments: list[Segment]) -> list[str]:
    return [s.job.job_id for s in segments]


def test_a_job_alone_fills_the_table_beyond_its_cap(scheduler):
    doc = make_job("doc", [1] * 20)
    scheduler.add(doc)
    assert admitted_by(scheduler.admit()) == ["doc"] * 8  # every row: a batch alone loses nothing to the cap
    assert doc.rows_held == 8 and len(doc.pending) == 12


def test_a_job_arriving_behind_a_capped_one_takes_the_next_free_rows(scheduler, clock):
    doc, short = make_job("doc", [1] * 20), make_job("short", [1, 1])
    scheduler.add(doc)
    scheduler.admit()
    scheduler.add(short)
    assert scheduler.admit() == []  # no free row
    assert not scheduler.could_admit()
    for seg in list(scheduler.running)[:3]:
        scheduler.release(seg)
    assert scheduler.could_admit()
    assert admitted_by(scheduler.admit()) == ["short", "short"]  # the doc keeps to its cap while short is in
    assert not scheduler.waiting.get(short, False) and short.rows_held == 2
    assert scheduler.table.rows_used == 7
    for seg in [s for s in scheduler.running if s.job is short]:
        scheduler.release(seg)
    clock.now += 0.05
    assert scheduler.could_admit()
    assert admitted_by(scheduler.admit()) == ["doc", "doc", "doc"]  # alone again: the doc fills the table


def test_a_large_job_widens_only_once_small_jobs_stopped_arriving_for_a_while(scheduler, clock):
    doc, short = make_job("doc", [1] * 20), make_job("short", [1])
    scheduler.add(short)
    scheduler.add(doc)
    assert admitted_by(scheduler.admit()) == ["short", "doc", "doc"]
    clock.now += 0.03
    scheduler.release(next(iter(scheduler.running)))  # short finished: no small job in, one arrived 30 ms ago
    assert not scheduler.could_admit()  # the step loop may keep making its batch on the device
    assert scheduler.admit() == []
    clock.now += 0.02
    assert scheduler.could_admit()  # 50 ms since the last small arrival
    assert admitted_by(scheduler.admit()) == ["doc"] * 6


def test_could_admit_says_what_admit_would_do(toy_dir):
    """Random job mixes and releases: could_admit is True exactly when admit takes a segment, whether rows or
    source tokens are short."""
    rng = random.Random(3)
    clock = Clock()
    table = SlotTable(load_config(toy_dir), 16, 16, 512, torch.float32, torch.device("cpu"))
    scheduler = Scheduler(table, None, row_cap=4, widen_after_s=0.05, clock=clock)
    for step in range(400):
        if rng.random() < 0.3:
            widths = [rng.choice([1, 1, 2, 4])] * rng.choice([1, 2, 3, 12])
            job = make_job(f"j{step}", widths)
            for seg in job.segments:  # sources long enough that the pool, not the rows, is sometimes short
                seg.src_ids = [5] * rng.randint(3, 90)
            scheduler.add(job)
        if scheduler.running and rng.random() < 0.5:
            scheduler.release(rng.choice(list(scheduler.running)))
        clock.now += rng.choice([0.0, 0.01, 0.03])
        predicted = scheduler.could_admit()
        assert predicted == bool(scheduler.admit()), step


def test_job_counts_follow_every_admission_release_failure_and_requeue(toy_dir):
    """The counts the engine's stats read (jobs in the engine, jobs holding rows) and the table's rows in use equal
    what the running and waiting sets say, through random arrivals, admissions, releases of one or several
    segments at once, failures and retries."""
    rng = random.Random(5)
    table = SlotTable(load_config(toy_dir), 16, 16, 512, torch.float32, torch.device("cpu"))
    scheduler = Scheduler(table, None, row_cap=4, widen_after_s=0.0)
    for step in range(500):
        if rng.random() < 0.3:
            scheduler.add(make_job(f"j{step}", [rng.choice([1, 2])] * rng.choice([1, 3, 9])))
        scheduler.admit()
        if scheduler.running and rng.random() < 0.6:  # one segment leaves, or several in one step
            leaving = rng.sample(list(scheduler.running), min(len(scheduler.running), rng.choice([1, 1, 2, 5])))
            scheduler.release(*leaving)
            if rng.random() < 0.1:  # a flagged segment's retry
                seg = leaving[0]
                scheduler.requeue(Segment(seg.job, seg.index, seg.src_ids, seg.search))
        if scheduler.jobs and rng.random() < 0.05:
            scheduler.fail(rng.choice(sorted(scheduler.jobs, key=attrgetter("job_id"))), Cancelled("test"))
        holding = {seg.job for seg in scheduler.running}
        assert scheduler.jobs_holding_rows == len(holding), step
        assert scheduler.jobs == holding | set(scheduler.waiting), step
        assert table.rows_used == sum(len(seg.rows) for seg in scheduler.running), step


def test_a_large_job_beside_a_running_small_one_keeps_to_its_cap(scheduler):
    short, doc = make_job("short", [1]), make_job("doc", [1] * 20)
    scheduler.add(short)
    scheduler.admit()
    scheduler.add(doc)
    assert admitted_by(scheduler.admit()) == ["doc", "doc"]
    assert scheduler.table.rows_used == 3  # five rows stay free for small jobs' narrow steps


def test_large_jobs_among_themselves_fill_the_table(scheduler):
    first, second = make_job("a", [1] * 20), make_job("b", [1] * 20)
    scheduler.add(first)
    scheduler.add(second)
    assert admitted_by(scheduler.admit()) == ["a", "a", "b", "b", "a", "a", "a", "a"]


def test_jobs_under_their_cap_are_served_in_order_before_any_goes_beyond(scheduler):
    first, second, third = make_job("a", [1] * 5), make_job("b", [1] * 5), make_job("c", [1] * 5)
    for job in (first, second, third):
        scheduler.add(job)
    assert admitted_by(scheduler.admit()) == ["a", "a", "b", "b", "c", "c", "a", "a"]


def test_a_segment_wider_than_the_cap_runs_alone_and_a_wide_one_is_not_overtaken(scheduler):
    beam, narrow = make_job("beam", [4, 4]), make_job("narrow", [1] * 10)
    scheduler.add(beam)
    assert admitted_by(scheduler.admit()) == ["beam", "beam"]  # cap 2 < 4: one segment, then beyond the cap
    scheduler.add(narrow)
    wide = make_job("wide", [4])
    scheduler.add(wide)
    scheduler.release(next(iter(scheduler.running)))  # 4 rows free
    assert admitted_by(scheduler.admit()) == ["narrow", "narrow"]  # narrow up to its cap; wide does not fit
    assert scheduler.admit() == []  # wide waits for 4 rows; narrow may not take more meanwhile
    scheduler.release(next(s for s in scheduler.running if s.job is beam))
    assert admitted_by(scheduler.admit()) == ["wide", "narrow", "narrow"]


def test_cancelled_job_leaves_the_queue_and_its_rows_are_free(scheduler):
    doc, short = make_job("doc", [1] * 20), make_job("short", [1])
    scheduler.add(doc)
    scheduler.admit()
    scheduler.add(short)
    assert scheduler.fail(doc, RuntimeError("cancelled")) == 8
    assert doc not in scheduler.waiting and not doc.pending
    assert admitted_by(scheduler.admit()) == ["short"]
    assert isinstance(doc.future.exception(0), RuntimeError)


def test_short_job_is_served_while_a_huge_document_runs(toy_dir):
    eng = Engine.load(toy_dir, device="cpu", max_rows=8, max_rows_per_job=2)
    try:
        rng = random.Random(9)
        doc = eng.submit_document("\n".join(f"{sample_sentence(rng)}." for _ in range(400)), "eng_Latn", "fra_Latn")
        end = time.monotonic() + 10
        while eng.stats().rows_used < eng.rows_total:
            assert time.monotonic() < end
            time.sleep(0.001)
        short = eng.submit(["rema sila", "tokala"], "eng_Latn", "deu_Latn")
        assert len(short.result(30)) == 2
        assert not doc.done()  # served while the document still ran
        assert len(doc.result(120).segments) == 400
    finally:
        eng.close()


def test_a_large_job_that_cannot_fit_at_once_leaves_a_reserve_beyond_its_cap(toy_dir):
    table = SlotTable(load_config(toy_dir), 16, 16, 256, torch.float32, torch.device("cpu"))
    scheduler = Scheduler(table, None, row_cap=8, widen_after_s=0)  # reserve 2
    doc = make_job("doc", [1] * 40)
    scheduler.add(doc)
    assert len(scheduler.admit()) == 14
    short = make_job("short", [1, 1])
    scheduler.add(short)
    assert admitted_by(scheduler.admit()) == ["short", "short"]  # at once, no segment of the doc had to end


def test_a_large_job_that_fits_at_once_takes_every_row(toy_dir):
    table = SlotTable(load_config(toy_dir), 16, 16, 256, torch.float32, torch.device("cpu"))
    scheduler = Scheduler(table, None, row_cap=8, widen_after_s=0)
    batch = make_job("batch", [2] * 8)  # 16 rows: all of the table
    scheduler.add(batch)
    assert admitted_by(scheduler.admit()) == ["batch"] * 8


def test_jobs_past_their_deadline_leave_running_or_waiting_and_free_their_rows(scheduler, monkeypatch):
    now = {"t": 1000.0}
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(time=lambda: now["t"], monotonic=time.monotonic))
    # segments wider than the cap run all the same: the two fill the table's 8 rows
    running, waiting, untimed = make_job("running", [4]), make_job("waiting", [2]), make_job("untimed", [4])
    running.deadline, waiting.deadline = 1010.0, 1020.0
    for job in (running, untimed, waiting):
        scheduler.add(job)
    scheduler.admit()
    assert running.rows_held == 4 and untimed.rows_held == 4 and waiting.pending
    scheduler.expire()
    assert not running.failed and scheduler.table.rows_used == 8
    now["t"] = 1015.0
    scheduler.expire()
    with pytest.raises(DeadlineExceeded, match="before it finished"):
        running.future.result(0)
    assert scheduler.table.rows_used == 4 and not waiting.failed and untimed.rows_held == 4
    now["t"] = 1025.0
    scheduler.expire()
    assert waiting.failed and waiting not in scheduler.waiting and not untimed.failed


def test_the_deadline_heap_keeps_to_about_the_jobs_in_the_engine(scheduler, monkeypatch):
    """Jobs that finish long before their deadline do not pile up in it under steady traffic."""
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(time=lambda: 0.0, monotonic=time.monotonic))
    for i in range(2000):
        job = make_job(f"j{i}", [1])
        job.deadline = 1e9
        scheduler.add(job)
        (seg,) = scheduler.admit()
        scheduler.release(seg)
    assert len(scheduler._deadlines) <= 2 * len(scheduler.jobs) + 64
