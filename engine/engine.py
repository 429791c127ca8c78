"""The engine: public API and its thread (the step itself: engine/step_loop.py).

Contract: text enters and leaves only through `Engine.submit`/`submit_document`/`translate`
(requests checked and tokenized in engine/submission.py, results made in engine/results.py);
below them everything is token ids and tensors. The engine knows nothing of AMQP or JSON. Jobs
are submitted from any thread and join the next step; one thread owns the model and the slot
table and runs schedule -> execute -> update until closed; cancellations and other tasks run
on it between steps.
"""
from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import torch

from engine.config import load_config, load_generation_defaults
from engine.devices import Backend, select_backend
from engine.errors import Cancelled, CheckpointError, EngineFailure
from engine.graphs import StepBounds, StepLora
from engine.lora import AdapterRegistry
from engine.model import NllbModel
from engine.jobs import Job, OnSegment
from engine.options import EngineStats, GenerationOptions, JobFuture, Translation
from engine.scheduler import Scheduler
from engine.slots import SOURCE_TOKENS_PER_ROW, SlotTable, bytes_per_row
from engine.step_inputs import SHARED_SOURCE_MIN_ROWS
from engine.step_loop import StepLoop
from engine.submission import JobBuilder, JobSettings, TextChecks
from engine.text import langid
from engine.tokenizer import Tokenizer
from engine.weights import load_weights

log = logging.getLogger("engine")

TOY_MODEL_DIR = Path(__file__).parent / "assets" / "toy"
TOY_ADAPTERS_DIR = Path(__file__).parent / "assets" / "adapters"  # LoRA adapters of the toy model


# The CPU's slot table: 64 rows, or up to 256 while their caches fit in 256 MiB. A small model's CPU step is mostly
# its fixed cost (Python and small ops), which more rows share: the toy model (0.3 MB a row) answers ~1,550
# single-sentence jobs a second through the worker with 256 rows against ~900 with 64 (bench.worker_rate). A
# large one's step is compute-bound well below 64 rows, and its rows are large (600M float32: 30 MB), so it keeps 64.
CPU_ROWS, CPU_MAX_ROWS, CPU_TABLE_BYTES = 64, 256, 256 << 20


def default_row_cap(rows_total: int) -> int:
    """A quarter of the rows, at most 128: beside interactive jobs a document's segments widen every step they
    share, and a step's time grows with its rows (600M on an H200: 0.7 ms at 1 row, 0.9 ms at 16, 1.6 ms at
    256; bench/RESULTS.md)."""
    return max(1, min(rows_total // 4, 128))


class Engine:
    def __init__(self, model_dir: Path, backend: Backend, max_rows: int | None, max_source_tokens: int,
                 adapters_dir: Path | None, max_adapters: int, max_lora_rank: int, memory_share: float,
                 max_rows_per_job: int | None, checks: TextChecks):
        self.cfg = load_config(model_dir)
        self.generation = load_generation_defaults(model_dir)
        self.tokenizer = Tokenizer.load(model_dir)
        self.backend = backend = backend.for_model(self.cfg)  # refuses what no path runs; reference ops stand in
        if self.tokenizer.vocab_size > self.cfg.vocab_size:
            raise CheckpointError(f"{model_dir}: sentencepiece.bpe.model maps to {self.tokenizer.vocab_size} ids but "
                                  f"config.json has vocab_size {self.cfg.vocab_size}; the tokenizer belongs to "
                                  "another checkpoint")
        weights = load_weights(model_dir, self.cfg, backend.dtype, backend.device)
        self.model = NllbModel(self.cfg, weights, backend.ops)
        self.model_name = self.cfg.name
        self.max_source_tokens = min(max_source_tokens, self.cfg.max_position_embeddings)
        self.adapters = AdapterRegistry(adapters_dir, self.cfg, weights, max_adapters, max_lora_rank, backend.dtype,
                                        backend.device) if adapters_dir else None  # before sizing the table
        target_len = min(self.cfg.max_position_embeddings, max(self.generation.max_length, 256))
        max_rows = max_rows or self._rows_from_memory(target_len, memory_share)
        self.table = SlotTable(self.cfg, max_rows, target_len,
                               max(self.max_source_tokens, SOURCE_TOKENS_PER_ROW * max_rows),
                               backend.dtype, backend.device)
        self.scheduler = Scheduler(self.table, self.adapters, max_rows_per_job or default_row_cap(max_rows))
        langid.library_labels()  # loads the identifier now, not on the engine thread at the first output it judges
        self.jobs = JobBuilder(self.cfg, self.generation, self.tokenizer, self.adapters, backend.device, target_len,
                               self.max_source_tokens, max_rows, checks)
        self.loop = StepLoop(self.cfg, self.model, self.tokenizer, self.table, self.scheduler, self.adapters, backend,
                             self.max_source_tokens)
        self.selector, self.prefill, self.graphs = self.loop.selector, self.loop.prefill, self.loop.graphs
        # jobs; (fn, future) tasks that run on the engine thread between steps; fn alone: posted (`post`); None:
        # close. A SimpleQueue: its put and get are C calls that hold the GIL ~0.05 us, where Queue's Python locking
        # took ~0.6 us each (4,096 one-sentence jobs: 4.8 -> 0.4 ms on the 2-core machine, time the engine thread
        # waited on the submitter)
        self._inbox: queue.SimpleQueue[Job | tuple[Callable[[], object], Future] | Callable[[], object] | None] = \
            queue.SimpleQueue()
        self._closed = False
        self._jobs_by_id: dict[str, list[JobFuture]] = {}  # unfinished jobs submitted with a job_id (for `cancel`)
        self._ids_lock = threading.Lock()
        self._cancelled_jobs = 0
        self._rows_freed_by_cancel = 0
        self._stats = EngineStats(max_rows, 0, 0, 0, 0)  # replaced whole by the engine thread
        self._stats_at = 0.0
        # what exists now (weights, tables, modules) lives as long as the engine: keep it out of
        # the cyclic collector's scans, which otherwise grow with every segment in flight
        gc.collect()
        gc.freeze()
        self._thread = threading.Thread(target=self._run, name="nllb-engine", daemon=True)
        self._thread.start()
        log.info("engine ready: model %s on %s/%s, %d rows x %d target tokens, %d source tokens",
                 self.model_name, backend.device, backend.dtype, max_rows, target_len, self.table.source_tokens)

    def _rows_from_memory(self, target_len: int, share: float) -> int:
        """Rows (a multiple of 8) that fit in `share` of the GPU's memory free after the weights; on the CPU, in
        CPU_TABLE_BYTES, between CPU_ROWS and CPU_MAX_ROWS."""
        per_row = bytes_per_row(self.cfg, target_len, self.backend.dtype)
        if self.backend.device.type == "cpu":
            return max(CPU_ROWS, min(CPU_MAX_ROWS, CPU_TABLE_BYTES // per_row // 8 * 8))
        free, _ = torch.cuda.mem_get_info(self.backend.device)
        rows = int(free * share) // per_row
        rows = max(8, min(4096, rows // 8 * 8))
        log.info("slot table sized from memory: %.1f GiB free, %.0f%% share -> %d rows", free / 2**30,
                 share * 100, rows)
        return rows

    @classmethod
    def load(cls, model_dir: str | Path | None = None, device: str = "auto", dtype: str | None = None,
             max_rows: int | None = None, adapters_dir: str | Path | None = None,
             max_source_tokens: int = 1024, max_adapters: int = 8, max_lora_rank: int = 64,
             memory_share: float = 0.6, max_rows_per_job: int | None = None,
             langid_threshold: float = langid.DEFAULT_THRESHOLD, output_warnings: bool = True) -> "Engine":
        """Load a checkpoint directory (None: the bundled toy model) and start the engine thread.
        `max_rows` None: on a GPU what `memory_share` of the free memory holds; on the CPU 64, or up to 256 for
        a small model (CPU_ROWS).
        `adapters_dir`: one PEFT LoRA folder per adapter name; up to `max_adapters` resident.
        `max_rows_per_job`: the rows a large job (a document) may hold while a small one is in the engine (None:
        `default_row_cap`; a segment wider than it still runs; see engine/scheduler.py).
        `langid_threshold`: src_lang "auto" below this confidence is UnknownLanguage. `output_warnings`: give text
        jobs' translations their warnings (engine/text/quality.py; about 60 us of host time per output)."""
        backend = select_backend(device, dtype)
        return cls(Path(model_dir) if model_dir else TOY_MODEL_DIR, backend, max_rows, max_source_tokens,
                   Path(adapters_dir) if adapters_dir else None, max_adapters, max_lora_rank, memory_share,
                   max_rows_per_job, TextChecks(langid_threshold, output_warnings))

    @property
    def rows_total(self) -> int:
        return self.table.rows_total

    # ---- submission (any thread) ---------------------------------------------------------
    def submit(self, texts: Sequence[str], src_lang: str, tgt_lang: str,
               options: GenerationOptions | None = None, adapter: str | None = None,
               deadline: float | None = None, on_warning: str = "flag", job_id: str | None = None,
               on_segment: OnSegment | None = None, check_outputs: bool = True) -> JobFuture:
        """Queue a job; the future resolves to one Translation per text, in order.
        Bad input raises here (InvalidRequest, UnknownLanguage, UnknownAdapter, TooLong). deadline (epoch seconds):
        a job not finished by then fails with DeadlineExceeded, waiting or decoding (its rows freed at that step).
        on_warning "retry": a segment with warnings is decoded once more (submission.retry_options) and the
        retry kept if it has none. job_id: what `cancel` knows the job by. on_segment(index, Translation):
        called from the engine thread as each text's translation is final (its exceptions are logged).
        check_outputs False: the translations' warnings are left empty for the caller to compute, off the
        engine thread, with engine.text.quality.translation_warnings(text, t.detected_lang or src_lang, tgt_lang,
        t) (~60 us a ~100-character text with the language identifier, which the engine thread would spend between
        steps: docs/language.md, Cost); a job with on_warning "retry" is checked here all the same."""
        settings = JobSettings(options, adapter, deadline, on_warning, job_id, on_segment, check_outputs)
        return self._queue(self.jobs.texts_job(texts, src_lang, tgt_lang, settings))

    def submit_document(self, doc: str, src_lang: str, tgt_lang: str,
                        options: GenerationOptions | None = None, adapter: str | None = None,
                        deadline: float | None = None, on_warning: str = "flag", job_id: str | None = None,
                        on_segment: OnSegment | None = None, max_chars: int = 100_000) -> JobFuture:
        """Queue one document: one job of its sentences (a repeated one decoded once, one too long for the
        model cut into pieces that fit), which fill free rows like any other segments. The future resolves
        to a DocumentTranslation in the source's layout; on_segment gets sentence indices. Over max_chars
        characters: TooLong. The other arguments as `submit`'s."""
        settings = JobSettings(options, adapter, deadline, on_warning, job_id, on_segment)
        return self._queue(self.jobs.document_job(doc, src_lang, tgt_lang, settings, max_chars))

    def submit_ids(self, src_ids_batch: Sequence[Sequence[int]], tgt_lang: str,
                   options: GenerationOptions | None = None, adapter: str | None = None,
                   deadline: float | None = None) -> JobFuture:
        """Token ids in (each `[src_lang] pieces </s>`); the future resolves to one Translation per source."""
        return self._queue(self.jobs.ids_job(src_ids_batch, tgt_lang, JobSettings(options, adapter, deadline)))

    def translate(self, texts: Sequence[str], src_lang: str, tgt_lang: str,
                  options: GenerationOptions | None = None, adapter: str | None = None) -> list[Translation]:
        return self.submit(texts, src_lang, tgt_lang, options, adapter).result()

    def generate(self, src_ids_batch: Sequence[Sequence[int]], tgt_lang: str,
                 options: GenerationOptions | None = None, adapter: str | None = None) -> list[Translation]:
        """Token ids in (each `[src_lang] pieces </s>`), Translations out (`.tokens` are the ids)."""
        return self.submit_ids(src_ids_batch, tgt_lang, options, adapter).result()

    def _queue(self, job: Job) -> JobFuture:
        if self._closed:
            raise EngineFailure("the engine is closed")
        future = job.future
        future._canceller = partial(self._request_cancel, job)
        if job.job_id is not None:
            with self._ids_lock:
                self._jobs_by_id.setdefault(job.job_id, []).append(future)
            future.add_done_callback(partial(self._forget, job.job_id))
        self._inbox.put(job)
        return future

    def _forget(self, job_id: str, future: JobFuture) -> None:
        with self._ids_lock:
            futures = self._jobs_by_id.get(job_id, [])
            if future in futures:
                futures.remove(future)
            if not futures:
                self._jobs_by_id.pop(job_id, None)

    def cancel(self, job_id: str) -> bool:
        """Cancel the unfinished jobs submitted with `job_id`: each leaves the admission queue, or frees its rows
        at the next step boundary, and its future raises Cancelled. False when none is known (unknown or
        finished: nothing happens)."""
        with self._ids_lock:
            futures = list(self._jobs_by_id.get(job_id, []))
        return any([future.cancel() for future in futures])

    def _request_cancel(self, job: Job) -> bool:
        """Queue the job's cancellation for the engine thread (after the job itself: the inbox is in order)."""
        if job.future.done() or self._closed:
            return False
        self._inbox.put((partial(self._cancel_now, job), Future()))
        return True

    def _cancel_now(self, job: Job) -> None:
        """On the engine thread, between steps: the job's rows are free from the next step on; its segments in
        the step in flight are skipped when its outcome is applied (StepLoop._apply_outcome)."""
        if job.future.done():
            return
        name = f"job {job.job_id!r}" if job.job_id is not None else "the job"
        self._rows_freed_by_cancel += self.scheduler.fail(job, Cancelled(f"{name} was cancelled before it finished"))
        self._cancelled_jobs += 1
        self._stats_at = 0.0  # publish the freed rows with the next snapshot

    def warm_up(self, rows: int, src_tokens: int, adapted: bool = False, beams: int = 1) -> int:
        """Capture now, on the engine thread between steps, the CUDA graphs that traffic of up to `rows`
        rows with sources of up to `src_tokens` tokens runs (with LoRA at the installed adapters' sites
        when `adapted`): the decode step's for every row bucket up to `rows` (with LoRA: under either slot
        bound) and outputs of up to step_loop.SHORT_TARGET tokens (a longer one's first step past it captures
        the capacity's), with `beams` > 1 also those of steps whose segments all search that many beams
        (from SHARED_SOURCE_MIN_ROWS rows), the prefill's for every token bucket up to the one `rows` sources
        of `src_tokens` take (EncoderGraphs.pack_size); so that such traffic never waits for a capture (~100 ms
        each). Returns how many graphs were captured (0 without graphs: CPU, or captures failed)."""
        if self.graphs is None:
            return 0

        def capture() -> int:
            bound = self.loop.src_bound(src_tokens)
            step_bounds = [(StepBounds(bound, self.loop.target_bound(1)), 1)]
            if beams > 1:
                step_bounds.append((StepBounds(bound, self.loop.target_bound(1), beams), SHARED_SOURCE_MIN_ROWS))
            pack = self.prefill.graphs.pack_size(rows * src_tokens, rows)
            if not (adapted and self.adapters is not None):
                return (sum(self.graphs.capture_upto(rows, b, None, smallest) for b, smallest in step_bounds)
                        + self.prefill.graphs.capture_upto(pack, bound, frozenset()))
            sites = self.adapters.installed_sites
            slot_bounds = {self.adapters.slot_bound(set()), self.adapters.slots}
            return (sum(self.graphs.capture_upto(rows, b, StepLora(sites, k), smallest)
                        for k in sorted(slot_bounds) for b, smallest in step_bounds)
                    + self.prefill.graphs.capture_upto(pack, bound, sites))
        return self._on_engine_thread(capture)

    def warm_up_sentences(self) -> int:
        """warm_up for a server's commonest traffic, at every row count: sources of up to 64 tokens (most sentences
        are under 32, nearly all under 64), greedy and beam 4 (the width most beam jobs ask for, and the one a
        retry decodes with). Returns how many graphs were captured."""
        return sum(self.warm_up(self.rows_total, tokens, beams=4) for tokens in (32, 64))

    def _on_engine_thread(self, fn: Callable[[], object]) -> object:
        """fn's result, run on the engine thread between steps (its exception is raised here; the
        engine keeps serving). EngineFailure when the engine closes first."""
        if self._closed:
            raise EngineFailure("the engine is closed")
        done: Future = Future()
        self._inbox.put((fn, done))
        return done.result()

    def post(self, fn: Callable[[], object]) -> None:
        """Run fn() on the engine thread between steps, without waiting for it: work that would otherwise take
        the GIL from the engine thread on another (worker/engine_link.py submits a pipe's jobs this way). Its
        exception is logged and the engine goes on; once the engine is closed, fn runs on the closing thread
        (an Engine.submit in it then raises EngineFailure)."""
        if self._closed:
            self._run_posted(fn)
            return
        self._inbox.put(fn)

    def stats(self) -> EngineStats:
        """The engine thread's latest snapshot (at most ~20 ms old) plus jobs not yet received.
        Safe from any thread: the scheduler's structures are only read by the engine thread."""
        snapshot = self._stats
        return replace(snapshot, jobs_waiting=snapshot.jobs_waiting + self._inbox.qsize())

    def _publish_stats(self) -> None:
        now = time.monotonic()
        if now - self._stats_at < 0.02 and not self.scheduler.idle:
            return
        sched = self.scheduler
        running = sched.jobs_holding_rows
        self._stats = EngineStats(self.table.rows_total, self.table.rows_used, len(sched.jobs) - running, running,
                                  self.loop.tokens_generated, self._cancelled_jobs, self._rows_freed_by_cancel)
        self._stats_at = now

    def is_alive(self) -> bool:
        """The engine thread runs (False after close() or if it died)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the engine thread; jobs not finished get EngineFailure (retry elsewhere)."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put(None)
        self._thread.join()
        if self.adapters is not None:
            self.adapters.close()

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        while self._receive():
            try:
                self.loop.step()
            except Exception:  # a bug or a device error: fail these jobs, keep serving
                log.exception("engine step failed; failing the jobs in flight")
                self.loop.in_flight = None
                self.scheduler.fail_all(EngineFailure("the engine failed while running this job"))
            self._publish_stats()
        self.scheduler.fail_all(EngineFailure("the engine was closed before this job finished"))
        while not self._inbox.empty():
            job = self._inbox.get()
            if isinstance(job, Job):
                job.settle(error=EngineFailure("the engine was closed before this job started"))
            elif isinstance(job, tuple):
                job[1].set_exception(EngineFailure("the engine was closed before this task ran"))
            elif job is not None:
                self._run_posted(job)

    def _receive(self) -> bool:
        """Move submitted jobs into the scheduler; False once close() was called. Blocks while
        idle; waits briefly when only jobs whose adapter is loading are left."""
        sched = self.scheduler
        timeout = None if sched.idle else 0.002 if not sched.running else 0
        try:
            job = self._inbox.get(block=timeout != 0, timeout=timeout)
            while True:
                if job is None:
                    return False
                if isinstance(job, Job):
                    self.scheduler.add(job)
                elif isinstance(job, tuple):  # a task (_on_engine_thread): runs here, between steps
                    self._run_task(*job)
                else:  # posted: its jobs join the inbox behind it, taken in this same pass
                    self._run_posted(job)
                job = self._inbox.get_nowait()
        except queue.Empty:
            return True

    @staticmethod
    def _run_posted(fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - the poster's bug must not stop the engine
            log.exception("a task posted to the engine thread failed")

    @staticmethod
    def _run_task(fn: Callable[[], object], done: Future) -> None:
        try:
            done.set_result(fn())
        except Exception as exc:  # noqa: BLE001 - the caller gets it; the engine keeps serving
            done.set_exception(exc)
