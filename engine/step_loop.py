"""The step loop: what the engine thread does between receiving jobs, one decode step at a time.

Each `step` is schedule -> execute -> update: admission and the batch (made on the device from the last
step's picks where the running set allows, else from the host tables), one decode step of every live row
(a CUDA graph replay on the GPU), then the last step's selection read and applied to the searches while
the GPU runs this one, and this step's selection launched. The loop owns the slot table's rows, the step
inputs, the selection and the CUDA graphs; jobs come and go through the scheduler (engine/scheduler.py),
and finished segments go to their jobs (engine/jobs.py). Only the engine thread calls it.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch

from engine import results
from engine.beam_search import BeamRows, BeamSearch
from engine.beam_step import BeamPicks
from engine.config import ModelConfig
from engine.devices import Backend, upload
from engine.errors import EngineFailure
from engine.graphs import DecodeGraphs, StepBounds, StepLora
from engine.jobs import Segment
from engine.lora import AdapterRegistry
from engine.model import LoraBatch, NllbModel
from engine.prefill import Prefill
from engine.scheduler import Scheduler
from engine.search import SingleRows, SingleSearch
from engine.selection import RowPicks, Selector, StepOutcome
from engine.slots import SlotTable
from engine.step_inputs import DecodeBatch, InFlight, RowInputs, StepInputs, prefill_inputs
from engine.tokenizer import Tokenizer

log = logging.getLogger("engine")

# the steps admission may wait for an eighth of the rows to be free while the table is nearly full: a job that
# arrives then starts at most this many steps later
ADMISSION_DELAY_STEPS = 4
# the decoder lengths a step's graph is planned for while every row is this short (else the table's capacity): the
# self-attention plans its split from that bound (ops.attention_plan), and for heads of 128 the capacity of 256
# positions splits each row's keys in two, a combine launch a layer that outputs under 128 tokens, most of them,
# would pay for nothing
SHORT_TARGET = 128
# the decoder of a step of at least this many rows runs as two halves on two streams (None: one chain): the
# halves share no data until the LM head, so one half's attention, which streams the caches at the bandwidth,
# could run beside the other's projections, whose short K loops leave the memory idle. Off until its A/B on the
# GPU shows a gain (docs/performance.md, "Two halves of a step")
SPLIT_ROWS: int | None = None


def split_halves(n: int, rows_per_source: int) -> tuple[slice, slice] | None:
    """The two row ranges a step of n rows splits into (SPLIT_ROWS), cut between runs of rows that share a source;
    None: the step runs whole."""
    if SPLIT_ROWS is None or n < SPLIT_ROWS:
        return None
    cut = -(-n // (2 * rows_per_source)) * rows_per_source
    return (slice(0, cut), slice(cut, n)) if 0 < cut < n else None


class StepLoop:
    def __init__(self, cfg: ModelConfig, model: NllbModel, tokenizer: Tokenizer, table: SlotTable,
                 scheduler: Scheduler, adapters: AdapterRegistry | None, backend: Backend, max_source_tokens: int):
        self.cfg, self.model, self.tokenizer, self.table = cfg, model, tokenizer, table
        self.scheduler, self.adapters, self.backend = scheduler, adapters, backend
        self.max_source_tokens = max_source_tokens
        rows = table.rows_total
        self.step_inputs = StepInputs(rows + 1)  # + the scratch row
        self.single_rows = SingleRows(table.target_len, cfg.eos_token_id, self.step_inputs.max_length)
        self.beam_rows = BeamRows(table.target_len, self.step_inputs.max_length)
        self.selector = Selector(cfg.eos_token_id, backend.ops, backend.device, self.beam_rows,
                                 graphs=backend.capturable)
        self.prefill = Prefill(model, table, adapters, backend)
        self.graphs = None
        self._side: torch.cuda.Stream | None = None  # a split step's second stream, made at its first split
        if backend.capturable:
            filler = RowInputs.filled(rows, backend.device, token=cfg.pad_token_id, position=0, row=table.scratch_row,
                                      src_start=0, src_len=1, adapter=0)
            self.graphs = DecodeGraphs(self._graph_step, rows, filler, model.logits_buffer)
        self.in_flight: InFlight | None = None  # the last step launched, its outcome not applied yet (see step)
        self.tokens_generated = 0  # cumulative, every row's every step
        self._admission_put_off = 0  # steps admission was put off in a row (_admission_due)
        self._by_mode: tuple[int, list[Segment]] = (-1, [])  # (scheduler version, _running_by_mode's list)
        # per slot row, the scheduler's admission count when its segment was admitted: a row whose serial is above
        # a batch's `admissions` belongs to a segment that came after that batch was made
        self._row_serial = np.zeros(rows + 1, dtype=np.int64)

    def step(self) -> None:
        """0. when every segment of the step in flight ends with it (each row at its max_length: a fixed batch's
        last step, one sentence's), its outcome first, so that no step is launched whose rows would all be
        dropped (a step of GPU time that the next job and a caller's sync waited behind: ~0.3 ms of one sentence);
        1. the batch: made on the device from the step in flight's picks when the running set is the same
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
        to make a batch where that is longer than a step, and at 0., where what it would run is all dropped.
        Before 1., the jobs whose deadline passed leave (their rows free for this step's admission)."""
        if self.in_flight is not None and self.in_flight.batch.steps_left <= 0:
            self._settle_in_flight()
        self.scheduler.expire()
        batch = self._batch_on_device()
        if batch is None:
            admitted = self.scheduler.admit()
            if admitted:
                self._prefill(admitted)
            batch = self._decode_batch(self._running_by_mode()) if self.scheduler.running else None
        logits = self._execute(batch) if batch is not None else None
        if self.in_flight is not None:
            self._settle_in_flight()
        if batch is not None:
            step_inputs = self.step_inputs
            selection = self.selector.launch(batch.segments, batch.version, batch.live, step_inputs.table.position,
                                             step_inputs.modes, logits, self.table.beam_scores, self.table.history)
            self.in_flight = InFlight(batch, selection)

    def _settle_in_flight(self) -> None:
        """The step in flight's selection read (waiting for the device) and applied to its segments."""
        self._apply_outcome(self.in_flight.batch, self._read_selection(self.in_flight))
        self.in_flight = None

    def _batch_on_device(self) -> DecodeBatch | None:
        """The next step's batch made on the device from the step in flight's picks (and beam steps, and forced
        language tokens), so that the GPU does not wait for the host between steps. Only where the host would
        make the same batch but for segments that left since (their rows compute on, wasted, and
        `_apply_outcome` drops their picks): no segment came since, every row's next position inside the
        table, at most an eighth of the rows wasted, and no admission due (`_admission_due`).
        None: make it from the host tables.
        On ragged traffic (a segment ends at nearly every step) this is what keeps the host's rebuild,
        admission and prefill to every few steps instead of every one."""
        f = self.in_flight
        if (f is None or f.batch.admissions != self.scheduler.admissions
                or f.batch.max_step + 1 >= self.table.target_len
                or 8 * (f.batch.live.size - self.table.rows_used) > f.batch.live.size
                or self._admission_due()):
            return None
        inputs = RowInputs(f.batch.inputs.buffer.clone())
        inputs.token.copy_(f.selection.next_tokens)
        inputs.position.add_(1)
        return replace(f.batch, inputs=inputs, max_step=f.batch.max_step + 1,
                       steps_left=f.batch.steps_left - 1)

    def _admission_due(self) -> bool:
        """Whether admission should run before the next step: it would take a segment, and an eighth of the rows
        are free or it was put off ADMISSION_DELAY_STEPS steps already. Each admission costs a batch and a plan
        rebuilt on the host and a prefill, so while the table is full, rows freed one by one are taken a batch
        at a time."""
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
        rows = self.step_inputs.admit(segments)
        self._row_serial[rows] = self.scheduler.admissions
        singles = [seg for seg in segments if isinstance(seg.search, SingleSearch)]
        if singles:
            for seg in singles:
                seg.search.bind(self.single_rows, seg.rows[0])
            starting = np.array([seg.rows[0] for seg in singles], dtype=np.int64)
            self.single_rows.start(starting, self.step_inputs.tokens[starting])  # the decoder start
        beams = [seg for seg in segments if isinstance(seg.search, BeamSearch)]
        if beams:
            self.beam_rows.start([seg.search for seg in beams], [seg.rows for seg in beams])
        rows = upload(rows, self.backend.device)
        self.table.history[rows] = rows.to(torch.int32)[:, None].expand(-1, self.table.target_len)
        tokens, cu_seqlens = prefill_inputs(segments)
        slots = {s.adapter_slot for s in segments} - {0}
        self.prefill.run(tokens, cu_seqlens, self.src_bound(int(np.diff(cu_seqlens).max())), slots)

    def _running_by_mode(self) -> list[Segment]:
        """The running segments, those of one selection mode together (greedy, sampled, then each beam width), in
        arrival order within each: each mode's logits rows are then one slice (plan.RowGroup.gather), not a copy.
        Made once a running set (the scheduler's version)."""
        version = self.scheduler.version
        if self._by_mode[0] != version:
            # plan_code >> 1: the rows and SAMPLED without HISTORY, which does not change the mode
            self._by_mode = (version, sorted(self.scheduler.running, key=lambda seg: seg.search.plan_code >> 1))
        return self._by_mode[1]

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
            inputs.token.index_copy_(0, new_at, self.in_flight.selection.next_tokens[old_at])
        src_bound = self.src_bound(int(host.src_len.max()))
        adapters = set(np.unique(host.adapter).tolist()) - {0}
        return DecodeBatch(segments, self.scheduler.version, self.scheduler.admissions, live, inputs, src_bound,
                           self.step_inputs.rows_per_source, adapters, int(host.position.max()),
                           self.step_inputs.steps_left(live, host.position))

    def _carried(self, live: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Of a batch's rows `live` [N], those carried over from the step in flight: their positions in this batch
        and in that one's (None: none)."""
        f = self.in_flight
        if f is None:
            return None
        old_position = np.full(self.table.rows_total + 1, -1, dtype=np.int64)
        old_position[f.batch.live] = np.arange(f.batch.live.size)
        old_at = old_position[live]
        new_at = np.flatnonzero((old_at >= 0) & (self._row_serial[live] <= f.batch.admissions))
        return (new_at, old_at[new_at]) if new_at.size else None

    def src_bound(self, src_len: int) -> int:
        """The power of two (32 at least) that decode graphs are planned with for sources this long."""
        return min(1 << (max(src_len, 32) - 1).bit_length(), self.max_source_tokens)

    def target_bound(self, length: int) -> int:
        """The bound on decoder lengths that decode graphs are planned with for rows at most this long (their step's
        own position included): SHORT_TARGET, or the table's capacity past it."""
        capacity = self.table.target_len
        return capacity if length > SHORT_TARGET else min(SHORT_TARGET, capacity)

    def _lora(self, idx: torch.Tensor, sites: set, slots: int) -> LoraBatch:
        """The adapters of the rows whose adapter slots are idx [N] (each below `slots`) at `sites`
        (lora.AdapterRegistry.batch)."""
        return self.adapters.batch(idx, sites, self.backend.ops, tiled=False, slots=slots)

    def _decode_logits(self, inputs: RowInputs[torch.Tensor], bounds: StepBounds, lora: LoraBatch | None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of the N rows of `inputs`; logits [N, V], written into `out` where given (NllbModel.logits).
        On the GPU the decoder of a step of SPLIT_ROWS rows or more runs as two halves on two streams
        (_decode_halves); the LM head is one product over every row either way."""
        halves = split_halves(inputs.size, bounds.rows_per_source) if inputs.buffer.is_cuda else None
        if halves is None:
            hidden = self._decode_hidden(inputs, bounds, lora)
        else:
            hidden = self._decode_halves(inputs, bounds, lora, halves)
        return self.model.logits(hidden, out)

    def _decode_halves(self, inputs: RowInputs[torch.Tensor], bounds: StepBounds, lora: LoraBatch | None,
                       halves: tuple[slice, slice]) -> torch.Tensor:
        """The decoder's hidden [N, d] of `inputs`, each of `halves` its own chain of layers, the first on the
        caller's stream and the second on the side stream; the caller's stream waits for both. Each half reads and
        writes only its own rows' slot rows, so the chains need nothing from each other."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.backend.device)
        hidden = torch.empty(inputs.size, self.cfg.d_model, dtype=self.backend.dtype, device=self.backend.device)
        main = torch.cuda.current_stream(self.backend.device)
        self._side.wait_stream(main)
        for part, stream in zip(halves, (main, self._side)):
            with torch.cuda.stream(stream):
                rows_lora = replace(lora, idx=lora.idx[part]) if lora is not None else None
                hidden[part].copy_(self._decode_hidden(inputs.columns(part), bounds, rows_lora))
        main.wait_stream(self._side)
        return hidden

    def _decode_hidden(self, inputs: RowInputs[torch.Tensor], bounds: StepBounds, lora: LoraBatch | None
                       ) -> torch.Tensor:
        """The decoder over the rows of `inputs` as one chain on the current stream: hidden [N, d]."""
        t = self.table
        return self.model.decode_step(inputs.token, inputs.position, inputs.row, inputs.src_start, inputs.src_len,
                                      t.self_k, t.self_v, t.history, t.cross_k, t.cross_v, lora,
                                      src_len_bound=bounds.source, self_len_bound=bounds.target,
                                      rows_per_source=bounds.rows_per_source)

    def _graph_step(self, inputs: RowInputs[torch.Tensor], bounds: StepBounds, lora: StepLora | None,
                    out: torch.Tensor) -> torch.Tensor:
        """The captured step: with `lora` (None: the base model), each row's slot read on the device; its logits
        written into `out`."""
        batch = self._lora(inputs.adapter, lora.sites, lora.slots) if lora else None
        return self._decode_logits(inputs, bounds, batch, out)

    def _execute(self, batch: DecodeBatch) -> torch.Tensor:
        """Shape: returns logits [N, V], a row for each batch row (those at position 0 take a forced token and are
        not read: the plan's groups index the others where they are, so no rows are copied out)."""
        logits = None
        slots = self.adapters.slot_bound(batch.adapter_slots) if batch.adapter_slots else 0
        bounds = StepBounds(batch.src_bound, self.target_bound(batch.max_step + 1), batch.rows_per_source)
        if self.graphs is not None:
            logits = self.graphs.run(batch.inputs, bounds,
                                     StepLora(self.adapters.installed_sites, slots) if slots else None)
        if logits is None:
            lora = None
            if slots:
                lora = self._lora(batch.inputs.adapter, self.adapters.active_sites(batch.adapter_slots), slots)
            logits = self._decode_logits(batch.inputs, bounds, lora)
        return logits

    def _read_selection(self, f: InFlight) -> StepOutcome:
        """The step in flight's selection read on the host (waiting for the device) and applied to the
        step inputs: each row's next input token and position (the device did the rest at launch). Rows
        admitted since that batch was made keep the inputs their admission gave them."""
        live, table = f.batch.live, self.step_inputs.table
        readmitted = live[self._row_serial[live] > f.batch.admissions]
        kept = table.buffer[:, readmitted]  # a copy (an index array)
        outcome = self.selector.finish(f.selection, self.step_inputs.tokens)
        self.step_inputs.advance(live)
        table.buffer[:, readmitted] = kept
        return outcome

    def _apply_outcome(self, batch: DecodeBatch, out: StepOutcome) -> None:
        """Apply a step's outcome to its segments' searches; finished segments leave the table and go to their
        job (which may hand back a retry to queue). A segment that already left (finished the step before, or
        its job failed or was cancelled) is skipped: its rows' picks are dropped."""
        running = self.scheduler.running
        for update in out.updates:
            if isinstance(update, RowPicks):
                self._append_picks(batch, update)
            else:
                self._advance_beams(update)
        finished = []
        for seg in batch.segments:
            if seg not in running:
                continue
            self.tokens_generated += len(seg.rows)
            if seg.search.done:
                finished.append(seg)
        if finished:
            self._finish(finished)

    def _append_picks(self, batch: DecodeBatch, picks: RowPicks) -> None:
        """One-row searches' picks appended to their sequences at once. A row admitted since `batch` was made holds
        a newer segment: its pick is dropped. The rows of a segment that left compute on: what they append is
        never read, and what they finish is not running."""
        running = self.scheduler.running
        ours = np.flatnonzero(self._row_serial[picks.rows] <= batch.admissions)
        if ours.size < picks.rows.size:
            picks = RowPicks([picks.segments[i] for i in ours], picks.rows[ours], picks.tokens[ours],
                             picks.logprobs[ours])
        done = self.single_rows.append(picks.rows, picks.tokens, picks.logprobs)
        finished = [i for i in np.flatnonzero(done).tolist() if picks.segments[i] in running]
        if finished:
            rows = self.single_rows.finished(picks.rows[finished])
            # their texts decode in the decode threads from here on, while this thread makes their answers
            texts = self.tokenizer.decode_many(rows.tokens, (rows.block, rows.count))
            for k, i in enumerate(finished):
                picks.segments[i].search.finish(rows, k, texts)

    def _advance_beams(self, picks: BeamPicks) -> None:
        """Beam segments' step decisions applied to their hypotheses at once; those of a segment that left are
        dropped (its rows may hold a newer segment's)."""
        segments, running = picks.step.segments, self.scheduler.running
        still = np.fromiter((seg in running for seg in segments), dtype=bool, count=len(segments))
        for i in self.beam_rows.advance(picks, still).tolist():
            segments[i].search.end()

    def _finish(self, segments: list[Segment]) -> None:
        """Finished segments leave the table and go to their jobs, their texts made together. What fails for one
        (its warnings, its job's answer) fails that job alone: the other jobs' segments are not its concern."""
        self.scheduler.release(*segments)
        for seg, found in zip(segments, results.candidates(segments, self.tokenizer)):
            if seg.job.failed:  # a segment of the same job failed before it
                continue
            try:
                retry = seg.job.finish_segment(seg, results.translation(seg, found))
            except Exception:  # noqa: BLE001 - a bug on one job's text path; the engine keeps serving
                log.exception("finishing a segment failed; failing its job")
                self.scheduler.fail(seg.job, EngineFailure("the engine failed while finishing this job"))
                continue
            if retry is not None and not seg.job.failed:
                self.scheduler.requeue(retry)
