"""The engine's API over a pipe (worker/engine_link.py), against the engine itself: what an EngineClient gives
is what the engine gives in-process (results, progress, refusals, cancellation), and either end going away is
noticed by the other: the engine's side cancels the jobs of a broker process that is gone, the broker side
fails its waiting jobs with EngineFailure when the engine's process is gone."""
from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine import GenerationOptions, JobFuture
from engine.errors import Cancelled, EngineError, EngineFailure, InvalidRequest, TooLong, UnknownLanguage
from worker.engine_client import EngineClient
from worker.engine_link import EngineLinks, EngineServer, hang_up

ROOT = Path(__file__).resolve().parents[2]
LONG = GenerationOptions(min_new_tokens=150, max_new_tokens=150)
TEXTS = ["ta deshacho lidor tu nizela", "kadera", "lidor tu", "nizela ta deshacho"]


@pytest.fixture(scope="module")
def links():
    """The engine process's reader and writer threads, shared by every pipe as in the worker."""
    shared = EngineLinks("test-link")
    yield shared
    shared.close()


@pytest.fixture
def link(engine, links):
    """(client, server, the broker side's raw end) over a real pipe to the session's toy engine."""
    theirs, ours = multiprocessing.Pipe()
    messages: list[tuple] = []
    server = EngineServer(engine, ours, messages.append, links)
    client = EngineClient(theirs)
    server.send(("stats", engine.stats(), engine.is_alive()))
    deadline = time.monotonic() + 10
    while not client.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    yield client, server, theirs, messages
    client.close()
    server.closed.wait(10)
    deadline = time.monotonic() + 20
    while not engine.scheduler.idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.scheduler.idle and engine.table.is_empty, "the link left work in the engine"


def same_translations(got, want) -> None:
    assert [(t.text, t.tokens, t.score, t.warnings) for t in got] == [(t.text, t.tokens, t.score, t.warnings)
                                                                        for t in want]


def test_texts_jobs_are_answered_as_the_engine_answers_them(link, engine):
    client, *_ = link
    for options in (None, GenerationOptions(num_beams=3, num_return_sequences=2, max_new_tokens=20)):
        future = client.submit(TEXTS, "eng_Latn", "fra_Latn", options=options)
        assert future.total == len(TEXTS)
        got = future.result(60)
        same_translations(got, engine.translate(TEXTS, "eng_Latn", "fra_Latn", options=options))
        assert future.started_at is not None and future.started_at <= time.monotonic()
    assert client.model_name == engine.model_name and client.rows_total == engine.rows_total


def test_a_document_with_progress_comes_back_whole_and_segment_by_segment(link, engine):
    client, *_ = link
    doc = "Ta deshacho lidor. Kadera tu nizela!\n\nLidor tu. Ta deshacho lidor."
    seen: dict[int, object] = {}
    want = engine.submit_document(doc, "eng_Latn", "fra_Latn").result(60)  # alone: batches move the last bits
    future = client.submit_document(doc, "eng_Latn", "fra_Latn", on_segment=seen.__setitem__)
    got = future.result(60)
    assert future.total == len(want.segments) == 4
    assert got.text == want.text
    same_translations([s.translation for s in got.segments], [s.translation for s in want.segments])
    deadline = time.monotonic() + 5  # the segment messages precede the result's in the pipe
    while len(seen) < future.total and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(seen) == list(range(future.total))
    same_translations([seen[i] for i in range(future.total)], [s.translation for s in want.segments])


@pytest.mark.parametrize("args, kwargs", [
    ((TEXTS, "xxx_Latn", "fra_Latn"), {}),
    ((TEXTS, "eng_Latn", "fra_Latn"), {"options": GenerationOptions(max_new_tokens=4000)}),
    ((["x " * 2000], "eng_Latn", "fra_Latn"), {}),
    (([], "eng_Latn", "fra_Latn"), {}),
    (("one text, not a list", "eng_Latn", "fra_Latn"), {}),
    ((TEXTS, "eng_Latn", "fra_Latn"), {"adapter": "nope"}),
])
def test_a_texts_refusal_is_the_futures_exception_with_the_engines_type_and_message(link, engine, args, kwargs):
    client, *_ = link
    with pytest.raises(EngineError) as direct:
        engine.submit(*args, **kwargs)
    future = client.submit(*args, **kwargs)
    with pytest.raises(EngineError) as remote:
        future.result(10)
    assert type(remote.value) is type(direct.value) and str(remote.value) == str(direct.value)
    assert type(direct.value) in (UnknownLanguage, InvalidRequest, TooLong) or direct.value.code == "unknown_adapter"


def test_a_document_refusal_raises_at_submission_as_the_engines_does(link):
    client, *_ = link
    with pytest.raises(TooLong, match="takes at most 10"):
        client.submit_document("Ta deshacho lidor. Kadera.", "eng_Latn", "fra_Latn", max_chars=10)
    with pytest.raises(UnknownLanguage):
        client.submit_document("Ta deshacho lidor.", "eng_Latn", "zzz_Latn")


def test_cancelling_through_the_client_frees_the_rows(link, engine):
    client, *_ = link
    by_future = client.submit(TEXTS, "eng_Latn", "fra_Latn", options=LONG)
    by_id = client.submit(TEXTS[:2], "eng_Latn", "fra_Latn", options=LONG, job_id="cancel-me")
    deadline = time.monotonic() + 20
    while engine.stats().rows_used == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert by_future.cancel()
    assert client.cancel("cancel-me") and not client.cancel("unknown-id")
    for future in (by_future, by_id):
        with pytest.raises(Cancelled):
            future.result(30)


def test_a_broker_process_gone_has_its_jobs_cancelled_in_the_engine(link, engine):
    client, server, theirs, _ = link
    future = client.submit(TEXTS, "eng_Latn", "fra_Latn", options=LONG)
    deadline = time.monotonic() + 20
    while engine.stats().rows_used == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    cancelled_before = engine.stats().cancelled_jobs
    hang_up(theirs)  # as a killed broker process's end closes
    assert server.closed.wait(10)
    deadline = time.monotonic() + 20
    while engine.stats().cancelled_jobs == cancelled_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().cancelled_jobs == cancelled_before + 1
    assert not future.done() or isinstance(future.exception(), EngineFailure)


def test_one_reader_and_one_writer_serve_every_pipe_and_one_gone_leaves_the_others(engine, links):
    pipes = [multiprocessing.Pipe() for _ in range(3)]
    servers = [EngineServer(engine, ours, lambda _: None, links) for _, ours in pipes]
    clients = [EngineClient(theirs) for theirs, _ in pipes]
    try:
        doomed = clients[0].submit(TEXTS, "eng_Latn", "fra_Latn", options=LONG)
        futures = [(c, c.submit([t], "eng_Latn", "fra_Latn")) for c in clients[1:] for t in TEXTS * 3]
        hang_up(pipes[0][0])  # one broker process gone while the others' jobs run
        assert servers[0].closed.wait(10)
        want = {t: engine.translate([t], "eng_Latn", "fra_Latn")[0] for t in TEXTS}
        for (client, future), text in zip(futures, (TEXTS * 3) * 2):
            same_translations(future.result(60), [want[text]])
        assert not doomed.done() or isinstance(doomed.exception(), EngineFailure)
        names = [t.name for t in threading.enumerate()]
        assert names.count("test-link-read") == names.count("test-link-write") == 1
    finally:
        for client in clients:
            client.close()
        for server in servers:
            assert server.closed.wait(10)


def test_the_engines_process_gone_fails_every_waiting_job_and_says_so(engine, links):
    theirs, ours = multiprocessing.Pipe()
    server = EngineServer(engine, ours, lambda _: None, links)
    client = EngineClient(theirs)
    lost = threading.Event()
    client.listen(lambda _: None, lost.set)
    future = client.submit(TEXTS, "eng_Latn", "fra_Latn", options=LONG)
    hang_up(ours)  # the engine's process dies: its end closes
    assert lost.wait(10)
    with pytest.raises(EngineFailure, match="gone"):
        future.result(10)
    with pytest.raises(EngineFailure):
        client.submit(TEXTS, "eng_Latn", "fra_Latn")
    assert not client.is_alive()
    with pytest.raises(EngineFailure):
        client.stats()
    assert server.closed.wait(10)  # its reader saw the end too, and cancelled the job in the engine
    deadline = time.monotonic() + 20
    while not engine.scheduler.idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.scheduler.idle


def test_stats_and_stops_come_from_the_engines_process(link, engine):
    client, server, _, messages = link
    stops: list[int] = []
    client.listen(stops.append, lambda: None)
    server.send(("stats", engine.stats(), False))
    server.send(("stop", 15))
    deadline = time.monotonic() + 5
    while not stops and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stops == [15]
    assert client.stats().rows_total == engine.rows_total
    assert not client.is_alive()  # the engine said it is not
    client.announce_ready()
    client.heartbeat(True)
    deadline = time.monotonic() + 5
    while len(messages) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert messages == [("ready",), ("heartbeat", True)]


def test_a_broker_process_imports_no_torch():
    """Its modules (the whole worker but the engine) leave torch out: four broker processes would otherwise hold
    ~250 MB each for nothing."""
    modules = "worker.processes, worker.service, worker.amqp, worker.health, worker.logs, worker.__main__"
    code = f"import sys, {modules}; sys.exit(int('torch' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


class ThreadSpy:
    """The engine, with the thread each submit ran on recorded, and posted work held until `release`."""

    def __init__(self, engine) -> None:
        self.engine, self.threads, self.held = engine, [], []
        self.holding = False

    def submit(self, *args, **kwargs):
        self.threads.append(("texts", threading.current_thread().name))
        return self.engine.submit(*args, **kwargs)

    def submit_document(self, *args, **kwargs):
        self.threads.append(("document", threading.current_thread().name))
        return self.engine.submit_document(*args, **kwargs)

    def post(self, fn):
        if self.holding:
            self.held.append(fn)
        else:
            self.engine.post(fn)

    def release(self):
        self.holding = False
        for fn in self.held:
            self.engine.post(fn)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_texts_jobs_are_submitted_on_the_engine_thread_and_documents_on_the_reader(engine, links):
    spy = ThreadSpy(engine)
    theirs, ours = multiprocessing.Pipe()
    server = EngineServer(spy, ours, lambda _: None, links)
    client = EngineClient(theirs)
    try:
        texts = client.submit(TEXTS, "eng_Latn", "fra_Latn")
        doc = client.submit_document("Ta deshacho lidor. Kadera tu nizela!", "eng_Latn", "fra_Latn")
        cancelled = client.submit(TEXTS, "eng_Latn", "fra_Latn", options=LONG)
        assert cancelled.cancel()  # in the same batch as its submit, or the next: after it either way
        same_translations(texts.result(60), engine.translate(TEXTS, "eng_Latn", "fra_Latn"))
        assert doc.result(60).text
        with pytest.raises(Cancelled):
            cancelled.result(30)
        assert sorted(set(spy.threads)) == [("document", "test-link-read"), ("texts", "nllb-engine")]
    finally:
        client.close()
        assert server.closed.wait(10)


def test_submits_still_posted_when_the_pipe_goes_are_dropped_not_run(engine, links):
    spy = ThreadSpy(engine)
    theirs, ours = multiprocessing.Pipe()
    server = EngineServer(spy, ours, lambda _: None, links)
    client = EngineClient(theirs)
    spy.holding = True
    client.submit(TEXTS, "eng_Latn", "fra_Latn", options=LONG)
    deadline = time.monotonic() + 10
    while not spy.held and time.monotonic() < deadline:
        time.sleep(0.01)
    assert spy.held, "the submit reached the engine's side"
    hang_up(theirs)  # the broker process dies with its job still posted
    assert server.closed.wait(10)
    jobs_before = engine.stats()
    spy.release()
    engine._on_engine_thread(lambda: None)  # past what was posted
    client.close()
    assert spy.threads == [] and engine.scheduler.idle
    assert engine.stats().cancelled_jobs == jobs_before.cancelled_jobs


class UnpicklableAnswers:
    """An engine whose every answer holds a lock (which does not pickle), finished at once."""

    model_name, rows_total = "fake", 4

    def submit(self, texts, src_lang, tgt_lang, **kwargs):
        future = JobFuture()
        future.total = len(texts)
        future.set_result([threading.Lock()])
        return future

    def post(self, fn):  # no engine thread: its work runs at once
        fn()


def test_an_answer_that_does_not_pickle_fails_its_job_and_no_other(engine, links):
    theirs, ours = multiprocessing.Pipe()
    server = EngineServer(UnpicklableAnswers(), ours, lambda _: None, links)
    client = EngineClient(theirs)
    futures = [client.submit(["x"], "eng_Latn", "fra_Latn") for _ in range(3)]
    for future in futures:
        with pytest.raises(RuntimeError, match="could not be sent to the broker process"):
            future.result(10)
    client.close()
    assert server.closed.wait(10)


def test_a_job_that_does_not_pickle_fails_at_once_and_the_link_goes_on(link, engine):
    client, *_ = link
    bad = client.submit(TEXTS, "eng_Latn", "fra_Latn", adapter=threading.Lock())
    good = client.submit(TEXTS, "eng_Latn", "fra_Latn")
    with pytest.raises(RuntimeError, match="could not be sent to the engine's process"):
        bad.result(10)
    same_translations(good.result(60), engine.translate(TEXTS, "eng_Latn", "fra_Latn"))


def test_a_failing_progress_callback_is_logged_and_the_link_goes_on(link, engine):
    client, *_ = link

    def broken(index, translation):
        raise ValueError("a bug in the submitter's callback")
    doc = client.submit_document("Ta deshacho lidor. Kadera tu nizela!", "eng_Latn", "fra_Latn", on_segment=broken)
    assert doc.result(60).text
    same_translations(client.submit(TEXTS, "eng_Latn", "fra_Latn").result(60),
                      engine.translate(TEXTS, "eng_Latn", "fra_Latn"))


class SubmitSpy:
    """The engine, with each texts submit's keyword arguments recorded."""

    def __init__(self, engine) -> None:
        self.engine, self.kwargs = engine, []

    def submit(self, *args, **kwargs):
        self.kwargs.append(dict(kwargs))
        return self.engine.submit(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


LOOPING = "rema sila " * 8  # the toy's copy task loops on it: repetition
ENGLISH = ["The committee will meet on Tuesday to discuss the new budget.",
           "Le comité se réunira mardi pour discuter du nouveau budget."]


def test_warnings_made_in_the_broker_process_are_the_engines_and_the_engine_leaves_them(engine, links):
    """With check_outputs the engine is asked not to check (its thread is spared), and the warnings the broker
    process makes are the ones the engine makes, in results and progress alike; a retry job is checked in the
    engine, which decides on the retry from them."""
    spy = SubmitSpy(engine)
    theirs, ours = multiprocessing.Pipe()
    server = EngineServer(spy, ours, lambda _: None, links)
    client = EngineClient(theirs, check_outputs=True)
    try:
        jobs = [([LOOPING, "rema sila to", "rema sila to ka tokala"], "eng_Latn", None),
                (["rema sila to ka tokala", "rema"], "eng_Latn", GenerationOptions(max_new_tokens=2)),
                (ENGLISH, "auto", None)]
        warned = set()
        for texts, src, options in jobs:
            seen: dict[int, object] = {}
            got = client.submit(texts, src, "deu_Latn", options=options, on_segment=seen.__setitem__).result(60)
            want = engine.translate(texts, src, "deu_Latn", options=options)
            same_translations(got, want)
            same_translations([seen[i] for i in range(len(texts))], want)
            warned.update(w for t in want for w in t.warnings)
        assert {"repetition", "truncated"} <= warned  # the jobs have warnings to agree on
        assert all(kwargs["check_outputs"] is False for kwargs in spy.kwargs)
        retried = client.submit([LOOPING], "eng_Latn", "fra_Latn", on_warning="retry").result(60)
        same_translations(retried, engine.submit([LOOPING], "eng_Latn", "fra_Latn", on_warning="retry").result(60))
        assert retried[0].retried and "check_outputs" not in spy.kwargs[-1]
    finally:
        client.close()
        server.closed.wait(10)


def test_a_stop_relayed_before_the_handlers_are_set_is_delivered_when_they_are(link, engine):
    """A broker process still starting when the worker stops (another failed at once) must still stop: the stop
    that came before `listen` is handed to it there, once."""
    client, server, _, _ = link
    server.send(("stop", 15))
    server.send(("stats", engine.stats(), False))  # read after the stop: once it is in, so is the stop
    deadline = time.monotonic() + 5
    while client.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not client.is_alive()
    stops: list[int] = []
    client.listen(stops.append, lambda: None)
    assert stops == [15]
    server.send(("stop", 2))  # later ones as they come
    deadline = time.monotonic() + 5
    while len(stops) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stops == [15, 2]


def test_a_pipe_whose_writing_fails_is_closed_and_the_others_are_answered(engine, links):
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    servers = [EngineServer(engine, ours, lambda _: None, links) for _, ours in pipes]
    broken, healthy = (EngineClient(theirs) for theirs, _ in pipes)
    lost = threading.Event()
    broken.listen(lambda _: None, lost.set)

    failed, write = [], servers[0].write

    def fail_once(messages):  # the first batch fails; the close queued behind it goes through
        if not failed:
            failed.append(messages)
            raise RuntimeError("a bug on one pipe's write path")
        write(messages)
    servers[0].write = fail_once
    try:
        doomed = broken.submit(TEXTS, "eng_Latn", "fra_Latn")
        assert lost.wait(10)  # the pipe was hung up: the broker side fails what it waits for
        with pytest.raises(EngineFailure):
            doomed.result(10)
        assert servers[0].closed.wait(10)
        same_translations(healthy.submit(TEXTS, "eng_Latn", "fra_Latn").result(60),
                          engine.translate(TEXTS, "eng_Latn", "fra_Latn"))
    finally:
        healthy.close()
        assert servers[1].closed.wait(10)


def test_closing_the_client_releases_a_submit_still_waiting_for_the_engine_to_take_its_job():
    """A document's submit waits, on a thread of the Service's, for the engine's process to take the job. A
    broker process that closes its link meanwhile (its jobs were stopped, say, by a lost channel) must not keep
    that thread, and its own exit, waiting SUBMIT_TIMEOUT_S: the submit fails at once."""
    theirs, ours = multiprocessing.Pipe()
    ours.send(("hello", "toy", 16))  # an engine's process that never answers after its hello
    client = EngineClient(theirs)
    outcome: list[BaseException] = []

    def submit() -> None:
        try:
            client.submit_document("Une phrase. Une autre.", "fra_Latn", "eng_Latn")
        except BaseException as e:  # noqa: BLE001 - what the waiting thread got
            outcome.append(e)
    waiting = threading.Thread(target=submit)
    waiting.start()
    time.sleep(0.2)
    assert waiting.is_alive()  # still waiting for the job to be taken
    started = time.monotonic()
    client.close()
    waiting.join(5)
    assert not waiting.is_alive() and time.monotonic() - started < 2
    assert len(outcome) == 1 and isinstance(outcome[0], EngineFailure) and "closed" in str(outcome[0])
    ours.close()
