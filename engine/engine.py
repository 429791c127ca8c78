"""The engine: public API, its thread, and the step loop.

Contract: text enters and leaves only through `Engine.submit`/`submit_document`/`translate`
(requests checked and tokenized in engine/submission.py, results made in engine/results.py);
below them everything is token ids and tensors. The engine knows nothing of AMQP or JSON. Jobs
are submitted from any thread and join the next step; one thread owns the model and the slot
table and runs schedule -> execute -> update until closed; cancellations and other tasks run
on it between steps.
"""
from __future__ import annotations

import gc
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from engine.config import load_config, load_generation_defaults
from engine.devices import Backend, select_backend, upload
from engine.errors import Cancelled, CheckpointError, EngineFailure
from engine.graphs import DecodeGraphs, StepLora
from engine.lora import AdapterRegistry
from engine.model import LoraBatch, NllbModel
from engine import results
from engine.jobs import Job, JobFuture, OnSegment, Segment
from engine.options import GenerationOptions, Translation
from engine.prefill import Prefill
from engine.scheduler import Scheduler
from engine.selection import Selector, StepOutcome
from engine.slots import SOURCE_TOKENS_PER_ROW, SlotTable, bytes_per_row
from engine.step_inputs import DecodeBatch, InFlight, RowInputs, StepInputs, prefill_inputs
from engine.submission import JobBuilder, JobSettings, TextChecks
from engine.text import langid
from engine.tokenizer import Tokenizer
from engine.weights import load_weights

log = logging.getLogger("engine")

TOY_MODEL_DIR = Path(__file__).parent / "assets" / "toy"
TOY_ADAPTERS_DIR = Path(__file__).parent / "assets" / "adapters"  # LoRA adapters of the toy model


@dataclass
class EngineStats:
    rows_total: int
    rows_used: int
    jobs_waiting: int  # jobs with a segment not yet admitted
    jobs_running: int  # jobs with a segment in the table
    tokens_generated: int  # cumulative, every row's every step
    cancelled_jobs: int = 0  # cumulative: jobs cancelled before they finished
    rows_freed_by_cancel: int = 0  # cumulative: rows those jobs held when cancelled


# the steps admission may wait for an eighth of the rows to be free while the table is nearly full: a job that
# arrives then starts at most this many steps later
ADMISSION_DELAY_STEPS = 4


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
        max_rows = max_rows or backend.default_rows or self._rows_from_memory(target_len, memory_share)
        self.table = SlotTable(self.cfg, max_rows, target_len,
                               max(self.max_source_tokens, SOURCE_TOKENS_PER_ROW * max_rows),
                               backend.dtype, backend.device)
        self.scheduler = Scheduler(self.table, self.adapters, max_rows_per_job or default_row_cap(max_rows))
        langid.library_labels()  # loads the identifier now, not on the engine thread at the first output it judges
        self.jobs = JobBuilder(self.cfg, self.generation, self.tokenizer, self.adapters, backend.device, target_len,
                               self.max_source_tokens, max_rows, checks)
        self.step_inputs = StepInputs(self.table.rows_total + 1)  # + the scratch row
        self.selector = Selector(self.cfg.eos_token_id, backend.ops, backend.device, graphs=backend.capturable)
        self.prefill = Prefill(self.model, self.table, self.adapters, backend)
        self.graphs = None
        if backend.capturable:
            scratch = self.table.scratch_row
            filler = RowInputs.filled(max_rows, backend.device, token=self.cfg.pad_token_id, position=0, row=scratch,
                                      src_start=0, src_len=1, adapter=0)
            self.graphs = DecodeGraphs(self._graph_step, max_rows, filler)
        self._in_flight: InFlight | None = None  # the last step launched, its outcome not applied yet (see _step)
        self._admission_put_off = 0  # steps admission was put off in a row (_admission_due)
        # per slot row, the scheduler's admission count when its segment was admitted: a row whose serial is above
        # a batch's `admissions` belongs to a segment that came after that batch was made
        self._row_serial = np.zeros(max_rows + 1, dtype=np.int64)
        # jobs; (fn, future) tasks that run on the engine thread between steps; None: close
        self._inbox: queue.Queue[Job | tuple[Callable[[], object], Future] | None] = queue.Queue()
        self._closed = False
        self._jobs_by_id: dict[str, list[Job]] = {}  # unfinished jobs submitted with a job_id (for `cancel`)
        self._ids_lock = threading.Lock()
        self._tokens_generated = 0
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
        """Rows that fit in `share` of the device memory free after the weights (multiple of 8)."""
        free, _ = torch.cuda.mem_get_info(self.backend.device)
        rows = int(free * share) // bytes_per_row(self.cfg, target_len, self.backend.dtype)
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
        `max_rows` None: 64 on the CPU, on a GPU what `memory_share` of the free memory holds.
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
               on_segment: OnSegment | None = None) -> JobFuture:
        """Queue a job; the future resolves to one Translation per text, in order.
        Bad input raises here (InvalidRequest, UnknownLanguage, UnknownAdapter, TooLong).
        on_warning "retry": a segment with warnings is decoded once more (submission.retry_options) and the
        retry kept if it has none. job_id: what `cancel` knows the job by. on_segment(index, Translation):
        called from the engine thread as each text's translation is final (its exceptions are logged)."""
        settings = JobSettings(options, adapter, deadline, on_warning, job_id, on_segment)
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
        job.future._canceller = partial(self._request_cancel, job)
        if job.job_id is not None:
            with self._ids_lock:
                self._jobs_by_id.setdefault(job.job_id, []).append(job)
            job.future.add_done_callback(lambda _: self._forget(job))
        self._inbox.put(job)
        return job.future

    def _forget(self, job: Job) -> None:
        with self._ids_lock:
            jobs = self._jobs_by_id.get(job.job_id, [])
            if job in jobs:
                jobs.remove(job)
            if not jobs:
                self._jobs_by_id.pop(job.job_id, None)

    def cancel(self, job_id: str) -> bool:
        """Cancel the unfinished jobs submitted with `job_id`: each leaves the admission queue, or frees its rows
        at the next step boundary, and its future raises Cancelled. False when none is known (unknown or
        finished: nothing happens)."""
        with self._ids_lock:
            jobs = list(self._jobs_by_id.get(job_id, []))
        return any([self._request_cancel(job) for job in jobs])

    def _request_cancel(self, job: Job) -> bool:
        """Queue the job's cancellation for the engine thread (after the job itself: the inbox is in order)."""
        if job.future.done() or self._closed:
            return False
        self._inbox.put((partial(self._cancel_now, job), Future()))
        return True

    def _cancel_now(self, job: Job) -> None:
        """On the engine thread, between steps: the job's rows are free from the next step on; its segments in
        the step in flight are skipped when its outcome is applied (_apply_outcome)."""
        if job.future.done():
            return
        name = f"job {job.job_id!r}" if job.job_id is not None else "the job"
        self._rows_freed_by_cancel += self.scheduler.fail(job, Cancelled(f"{name} was cancelled before it finished"))
        self._cancelled_jobs += 1
        self._stats_at = 0.0  # publish the freed rows with the next snapshot

    def warm_up(self, rows: int, src_tokens: int, adapted: bool = False) -> int:
        """Capture now, on the engine thread between steps, the CUDA graphs that traffic of up to `rows`
        rows with sources of up to `src_tokens` tokens runs (with LoRA at the installed adapters' sites
        when `adapted`): the decode step's for every row bucket up to `rows` (with LoRA: under either slot
        bound), the prefill's for every token bucket up to `rows` x `src_tokens`; so that such traffic never
        waits for a capture (~100 ms each). Returns how many graphs were captured (0 without graphs: CPU, or
        captures failed)."""
        if self.graphs is None:
            return 0

        def capture() -> int:
            bound = self._src_bound(src_tokens)
            if not (adapted and self.adapters is not None):
                return (self.graphs.capture_upto(rows, bound, None)
                        + self.prefill.graphs.capture_upto(rows * src_tokens, bound, frozenset()))
            sites = self.adapters.installed_sites
            slot_bounds = {self.adapters.slot_bound(set()), self.adapters.slots}
            return (sum(self.graphs.capture_upto(rows, bound, StepLora(sites, k)) for k in sorted(slot_bounds))
                    + self.prefill.graphs.capture_upto(rows * src_tokens, bound, sites))
        return self._on_engine_thread(capture)

    def _on_engine_thread(self, fn: Callable[[], object]) -> object:
        """fn's result, run on the engine thread between steps (its exception is raised here; the
        engine keeps serving). EngineFailure when the engine closes first."""
        if self._closed:
            raise EngineFailure("the engine is closed")
        done: Future = Future()
        self._inbox.put((fn, done))
        return done.result()

    def stats(self) -> EngineStats:
        """The engine thread's latest snapshot (at most ~20 ms old) plus jobs not yet received.
        Safe from any thread: the scheduler's structures are only read by the engine thread."""
        snapshot = self._stats
        return replace(snapshot, jobs_waiting=snapshot.jobs_waiting + self._inbox.qsize())

    def _publish_stats(self) -> None:
        now = time.monotonic()
        if now - self._stats_at < 0.02 and not self.scheduler.idle:
            return
        running = {id(s.job) for s in self.scheduler.running}
        waiting = {id(job) for job in self.scheduler.waiting} - running
        self._stats = EngineStats(self.table.rows_total, self.table.rows_used, len(waiting), len(running),
                                  self._tokens_generated, self._cancelled_jobs, self._rows_freed_by_cancel)
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
                self._step()
            except Exception:  # a bug or a device error: fail these jobs, keep serving
                log.exception("engine step failed; failing the jobs in flight")
                self._in_flight = None
                self.scheduler.fail_all(EngineFailure("the engine failed while running this job"))
            self._publish_stats()
        self.scheduler.fail_all(EngineFailure("the engine was closed before this job finished"))
        while not self._inbox.empty():
            job = self._inbox.get()
            if isinstance(job, Job) and not job.future.done():
                job.future.set_exception(EngineFailure("the engine was closed before this job started"))
            elif isinstance(job, tuple):
                job[1].set_exception(EngineFailure("the engine was closed before this task ran"))

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
                else:  # a task (_on_engine_thread): runs here, between steps
                    self._run_task(*job)
                job = self._inbox.get_nowait()
        except queue.Empty:
            return True

    @staticmethod
    def _run_task(fn: Callable[[], object], done: Future) -> None:
        try:
            done.set_result(fn())
        except Exception as exc:  # noqa: BLE001 - the caller gets it; the engine keeps serving
            done.set_exception(exc)

    def _step(self) -> None:
        """1. the batch: made on the device from the step in flight's picks when the running set is the same
        but for departures (`_batch_on_device`); else admission (the encoder for new segments, queued behind
        the step in flight) and the batch from the host tables, the rows carried over from the step in flight
        taking their tokens from its picks on the device; 2. execute it (one decode step for all rows);
        3. read the step in flight's selection and apply its outcome to the segments' searches, while the GPU
        runs this step; 4. launch this step's selection on the device.
        A segment that finished in the step in flight is in this step's batch too (its end is only known in
        3.), and in the steps made on the device after it; its rows compute wasted steps whose outcomes
        `_apply_outcome` skips.
        The loop's one wait for the device is `_read_selection` (the searches need the picks on the host), and
        this step is queued before it: the GPU never waits for the host's bookkeeping, only for the host's time
        to make a batch where that is longer than a step."""
        batch = self._batch_on_device()
        if batch is None:
            admitted = self.scheduler.admit()
            if admitted:
                self._prefill(admitted)
            running = self.scheduler.running
            batch = self._decode_batch(list(running)) if running else None
        logits = self._execute(batch) if batch is not None else None
        if self._in_flight is not None:
            self._read_selection()
            self._apply_outcome(self._in_flight.batch, self._in_flight.outcome)
            self._in_flight = None
        if batch is not None:
            selection = self.selector.launch(batch.segments, batch.version, batch.live, logits, batch.logit_rows,
                                             self.table.beam_scores, self.table.history)
            self._in_flight = InFlight(batch, selection)

    def _batch_on_device(self) -> DecodeBatch | None:
        """The next step's batch made on the device from the step in flight's picks (and beam steps, and forced
        language tokens), so that the GPU does not wait for the host between steps. Only where the host would
        make the same batch but for segments that left since (their rows compute on, wasted, and
        `_apply_outcome` drops their picks): no segment came since, every row's next position inside the
        table, at most an eighth of the rows wasted, and no admission due (`_admission_due`).
        None: make it from the host tables.
        On ragged traffic (a segment ends at nearly every step) this is what keeps the host's rebuild,
        admission and prefill to every few steps instead of every one."""
        f = self._in_flight
        if (f is None or f.outcome is not None or f.batch.admissions != self.scheduler.admissions
                or f.batch.max_step + 1 >= self.table.target_len
                or 8 * (f.batch.live.size - self.table.rows_used) > f.batch.live.size
                or self._admission_due()):
            return None
        inputs = RowInputs(f.batch.inputs.buffer.clone())
        inputs.token.copy_(f.selection.next_tokens)
        inputs.position.add_(1)
        return replace(f.batch, inputs=inputs, logit_rows=None, max_step=f.batch.max_step + 1)

    def _admission_due(self) -> bool:
        """Whether admission should run before the next step: it would take a segment, and an eighth of the rows
        are free or it was put off ADMISSION_DELAY_STEPS steps already. Each admission costs a step made on the
        host (the GPU waits for it) and a prefill, so while the table is full, rows freed one by one are
        taken a batch at a time."""
        if not self.scheduler.could_admit():
            self._admission_put_off = 0
            return False
        free = self.table.rows_total - self.table.rows_used
        if 8 * free >= self.table.rows_total or self._admission_put_off >= ADMISSION_DELAY_STEPS:
            self._admission_put_off = 0
            return True
        self._admission_put_off += 1
        return False

    def _prefill(self, segments: list[Segment]) -> None:
        """Admitted segments' rows start fresh (own history, step inputs at position 0); their sources go
        through the encoder into the pool (engine/prefill.py). A row may still be in the step in flight (its
        segment left after that batch was made): the device writes here are queued behind that step, and its
        serial tells `_read_selection` and `_decode_batch` that it is no longer that batch's."""
        rows = np.array([r for s in segments for r in s.rows], dtype=np.int64)
        self._row_serial[rows] = self.scheduler.admissions
        rows = upload(rows, self.backend.device)
        self.table.history[rows] = rows.to(torch.int32)[:, None].expand(-1, self.table.target_len)
        for seg in segments:
            self.step_inputs.admit(seg)
        tokens, cu_seqlens = prefill_inputs(segments)
        slots = {s.adapter_slot for s in segments} - {0}
        self.prefill.run(tokens, cu_seqlens, self._src_bound(int(np.diff(cu_seqlens).max())), slots)

    def _decode_batch(self, segments: list[Segment]) -> DecodeBatch:
        """The batch of the running segments from the host tables. A row carried over from the step in flight
        (its segment was in that batch and still holds it) has not been read on the host yet: its position is
        one on, and its token is that step's pick, copied on the device."""
        live = self.step_inputs.live(segments, self.scheduler.version)
        host = self.step_inputs.gather(live)
        carried = self._carried(live)
        if carried is not None:
            host.position[carried[0]] += 1
        device = self.backend.device
        inputs = RowInputs(upload(host.buffer, device))
        if carried is not None:
            new_at, old_at = (upload(a, device) for a in carried)
            inputs.token.index_copy_(0, new_at, self._in_flight.selection.next_tokens[old_at])
        logit_rows = None
        if not host.position.all():  # rows at position 0 take the forced token: no logits needed
            logit_rows = upload(np.flatnonzero(host.position), device)
        src_bound = self._src_bound(int(host.src_len.max()))
        adapters = set(np.unique(host.adapter).tolist()) - {0}
        return DecodeBatch(segments, self.scheduler.version, self.scheduler.admissions, live, inputs, logit_rows,
                           src_bound, adapters, int(host.position.max()))

    def _carried(self, live: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Of a batch's rows `live` [N], those carried over from the step in flight: their positions in this batch
        and in that one's (None: none)."""
        f = self._in_flight
        if f is None:
            return None
        old_position = np.full(self.table.rows_total + 1, -1, dtype=np.int64)
        old_position[f.batch.live] = np.arange(f.batch.live.size)
        old_at = old_position[live]
        new_at = np.flatnonzero((old_at >= 0) & (self._row_serial[live] <= f.batch.admissions))
        return (new_at, old_at[new_at]) if new_at.size else None

    def _src_bound(self, src_len: int) -> int:
        """The power of two (32 at least) that decode graphs are planned with for sources this long."""
        return min(1 << (max(src_len, 32) - 1).bit_length(), self.max_source_tokens)

    def _lora(self, idx: torch.Tensor, sites: set, slots: int) -> LoraBatch:
        """The adapters of the rows whose adapter slots are idx [N] (each below `slots`) at `sites`
        (lora.AdapterRegistry.batch)."""
        return self.adapters.batch(idx, sites, self.backend.ops, tiled=False, slots=slots)

    def _decode_logits(self, inputs: RowInputs[torch.Tensor], src_bound: int, lora: LoraBatch | None) -> torch.Tensor:
        """One decode step of the N rows of `inputs`; logits [N, V]."""
        t = self.table
        hidden = self.model.decode_step(inputs.token, inputs.position, inputs.row, inputs.src_start, inputs.src_len,
                                        t.self_k, t.self_v, t.history, t.cross_k, t.cross_v, lora,
                                        src_len_bound=src_bound)
        return self.model.logits(hidden)

    def _graph_step(self, inputs: RowInputs[torch.Tensor], src_bound: int, lora: StepLora | None) -> torch.Tensor:
        """The captured step: with `lora` (None: the base model), each row's slot read on the device."""
        batch = self._lora(inputs.adapter, lora.sites, lora.slots) if lora else None
        return self._decode_logits(inputs, src_bound, batch)

    def _execute(self, batch: DecodeBatch) -> torch.Tensor:
        """Shape: returns logits [N', V] for the rows that need them (step > 0), in batch order."""
        logits = None
        slots = self.adapters.slot_bound(batch.adapter_slots) if batch.adapter_slots else 0
        if self.graphs is not None:
            logits = self.graphs.run(batch.inputs, batch.src_bound,
                                     StepLora(self.adapters.installed_sites, slots) if slots else None)
        if logits is None:
            lora = None
            if slots:
                lora = self._lora(batch.inputs.adapter, self.adapters.active_sites(batch.adapter_slots), slots)
            logits = self._decode_logits(batch.inputs, batch.src_bound, lora)
        return logits if batch.logit_rows is None else logits[batch.logit_rows]

    def _read_selection(self) -> None:
        """The step in flight's selection read on the host (waiting for the device) and applied to the
        step inputs: each row's next input token and position (the device did the rest at launch). Rows
        admitted since that batch was made keep the inputs their admission gave them."""
        f = self._in_flight
        if f is None or f.outcome is not None:
            return
        live, table = f.batch.live, self.step_inputs.table
        readmitted = live[self._row_serial[live] > f.batch.admissions]
        kept = table.buffer[:, readmitted]  # a copy (an index array)
        f.outcome = self.selector.finish(f.selection, self.step_inputs.tokens)
        self.step_inputs.advance(live)
        table.buffer[:, readmitted] = kept

    def _apply_outcome(self, batch: DecodeBatch, out: StepOutcome) -> None:
        """Apply a step's outcome to its segments' searches; finished segments leave the table and go to their
        job (which may hand back a retry to queue). A segment that already left (finished the step before, or
        its job failed or was cancelled) is skipped: its rows' picks are dropped."""
        running = self.scheduler.running
        for seg, args in itertools.chain.from_iterable(out.updates):
            if seg in running:
                seg.search.advance(*args)
        for seg in batch.segments:
            if seg not in running:
                continue
            seg.steps += 1
            self._tokens_generated += len(seg.rows)
            if seg.search.done:
                self._finish(seg)

    def _finish(self, seg: Segment) -> None:
        """A finished segment leaves the table and goes to its job. What fails here (making its text, its
        warnings, the job's answer) fails that job alone: the other jobs' segments are not its concern."""
        self.scheduler.release(seg)
        try:
            translation = results.translation(seg, self.tokenizer, self.cfg.eos_token_id)
            retry = seg.job.finish_segment(seg, translation)
        except Exception:  # noqa: BLE001 - a bug on one job's text path; the engine keeps serving
            log.exception("finishing a segment failed; failing its job")
            self.scheduler.fail(seg.job, EngineFailure("the engine failed while finishing this job"))
            return
        if retry is not None and not seg.job.failed:
            self.scheduler.requeue(retry)
