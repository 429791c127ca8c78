"""Token selection for every live row of a step: batched on the device, bookkeeping vectorized on the host.

Per mode, in HF's order: greedy takes argmax of the processed logits; sampling warps them
(temperature, top-k, top-p) and draws with the segment's own generator; beam search takes
log-softmax, processors, adds each row's running score and keeps the top 2 x num_beams over
the segment's num_beams x V scores. All of it is batched across segments and comes back to the
host in ONE transfer. At decoder length 1 the forced language token needs no logits at all.

Host cost per step is what limits a large batch, so:
- what a step needs to know about its segments (mode, where their rows are, whether </s> is banned)
  only changes when segments come or go or cross a phase boundary (the forced first step, the end
  of min_new_tokens); it is planned once (engine/plan.py, with its device index tensors) and reused;
- beam search's per-step decisions (which candidates run on, their scores, the cache reorder) are
  taken for every segment of a beam width at once, on the device at launch and again in numpy when
  the host reads the candidates (engine/beam_step.py), and applied later, while the next step runs, to all
  their hypotheses at once (engine/beam_search.py); a segment's own Python runs only where a candidate of its
  finished.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from engine import processors
from engine import beam_step
from engine.beam_search import BeamRows, BeamSearch, forced_candidates
from engine.beam_step import BeamStepInputs
from engine.devices import upload
from engine.plan import Plan, RowGroup, RowModes, build
from engine.selection_graph import SelectionGraph


@dataclass
class RowPicks:
    """A step's picks for its one-row segments of one mode (greedy or sampled), which the engine appends to their
    searches at once (search.SingleRows.append)."""

    segments: list  # [n] the segments, in batch order
    rows: np.ndarray  # [n] int64 their slot rows
    tokens: np.ndarray  # [n] int64 the picks
    logprobs: np.ndarray  # [n] float64 the picks' log-probs


@dataclass
class StepOutcome:
    """What a step decided for the searches, which the engine applies later (while the next step runs): RowPicks
    of one-row segments and BeamPicks (engine/beam_step.py) of beam ones, every segment of the step between them."""

    updates: list


@dataclass
class Selection:
    """A step's selection launched on the device (Selector.launch), its result not read on the host yet."""

    plan: Plan
    host: torch.Tensor  # float64 on the host (pinned, filled asynchronously): the step's one transfer
    done: torch.cuda.Event | None  # recorded after the transfer (None on the CPU: already done)
    vocab: int
    next_tokens: torch.Tensor  # [N] int64 on the device: each batch row's next input
    beam_steps: list  # BeamStepInputs of each beam group, in plan order
    forced_beams: list  # (BeamStepInputs, scores, parents, tokens) host arrays of forced beam segments


class Selector:
    """Selection with its plan cache; one per engine, used by the engine thread only."""

    def __init__(self, eos_id: int, ops: ModuleType, device: torch.device, beam_rows: BeamRows,
                 graphs: bool = False):
        """beam_rows: the beam segments' host state, which a step's inputs are read from; graphs: capture the device
        part of long-lived small plans (engine/selection_graph.py); CUDA kernels only."""
        self.eos_id, self.ops, self.device, self.beam_rows = eos_id, ops, device, beam_rows
        self.steps = 0
        self.plan: Plan | None = None
        self.graph = SelectionGraph() if graphs else None

    def launch(self, segments: list, version: int, live: np.ndarray, positions: np.ndarray, modes: RowModes,
               logits: torch.Tensor, row_scores: torch.Tensor, history: torch.Tensor) -> "Selection":
        """Every segment's next token chosen on the device, beams' cache reorder and running scores applied
        there, and the result's copy to the host started; `finish` reads it. The searches themselves
        advance when the engine applies the outcome's `updates`, which must happen before the next launch.
        Shape: live [N] int64, the segments' slot rows in order (as when the batch was made: a segment may
        have left since); positions [R] int64 every slot row's decoder position at this step and modes the rows'
        segments' plan codes (engine/plan.py `build` reads them); logits [N, V] (model dtype; read as float32),
        a row for each batch row (those at decoder length 1 are not read); row_scores [R] float32 running beam
        score per slot row; history [R, T] int32."""
        plan = self._plan(segments, version, live, positions, modes)
        self.steps += 1
        steps = [self.beam_rows.step_inputs(group.segments, group.slot_rows.reshape(-1, nb))
                 for nb, group in plan.beams.items()]
        replayed = None
        if self.graph is not None:
            replayed = self.graph.run(plan, logits, steps,
                                      lambda metas: self._on_device(plan, steps, logits, row_scores, history, metas))
        payload, next_tokens = replayed or self._on_device(plan, steps, logits, row_scores, history)
        forced_beams = self._forced_beam_steps(plan, history, row_scores)
        if plan.forced:
            self._write_forced(plan, next_tokens, forced_beams)
        # the one host transfer of the step, not waited for here
        host = payload.to("cpu", non_blocking=True) if payload is not None else torch.zeros(0, dtype=torch.double)
        done = None
        if logits.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return Selection(plan, host, done, logits.shape[-1], next_tokens, steps,
                         [(step, scores, parents, tokens) for step, scores, parents, tokens, _ in forced_beams])

    @staticmethod
    def _write_forced(plan: Plan, next_tokens: torch.Tensor, forced_beams: list) -> None:
        """The forced segments' next tokens written into next_tokens [N] int64: the forced language token of greedy
        and sampled segments at their first step, the forced beam steps' tokens."""
        single = [(at, seg.search.ctx.forced_id) for seg, at in zip(plan.forced, plan.forced_at)
                  if not isinstance(seg.search, BeamSearch)]
        if single:
            at, tokens = np.array(single, dtype=np.int64).T
            next_tokens.index_copy_(0, upload(at, next_tokens.device), upload(tokens, next_tokens.device))
        for *_, (at, kept) in forced_beams:
            next_tokens.index_copy_(0, upload(at, next_tokens.device), kept)

    def _on_device(self, plan: Plan, steps: list[BeamStepInputs], logits: torch.Tensor, row_scores: torch.Tensor,
                   history: torch.Tensor, metas: list[torch.Tensor] | None = None) -> tuple:
        """The step's selection on the device: (payload, next tokens). payload [P] float64 is what the host
        reads (float64 keeps token and beam indices exact; cat promotes the int64 parts to it), None when
        empty; next tokens [N] int64, each batch row's (0 for rows in no group: `_write_forced` writes the forced
        ones', and those of a segment that left before its first step compute on, never read). metas: each beam
        group's BeamStepInputs.meta on the device (None: uploaded here)."""
        device_out = []  # tensors fetched to the host together, in this order
        next_parts = []  # (logits rows, their next tokens, whether those rows are all rows in order) on the device
        # 1. greedy: argmax over the processed logits; the log-prob of the pick for the score
        if plan.greedy.rows:
            tokens, logprobs = self.ops.greedy_select(self._greedy_scores(logits, plan.greedy))
            device_out += [tokens.double(), logprobs.double()]
            next_parts.append((plan.greedy.index_t, tokens, plan.greedy.is_all(logits)))
        # 2. sampling: processors and warpers batched; then torch.multinomial's own one-sample draw with each
        #    segment's generator (its seeded stream: same seed, same draw, in any batch, as HF's); the log-prob
        #    is of the processed, unwarped scores, as HF scores it
        if plan.sampled:
            segments = plan.sampled
            every_row = len(segments) == logits.shape[0]  # in row order: sampled_index_t is then 0..N-1
            scores = (logits if every_row else self.ops.gather_rows(logits, plan.sampled_index_t)).float()
            processors.history_processors(self.ops, scores, [(seg, i) for i, seg in enumerate(segments)
                                                             if processors.acts_on(seg.search)], self.eos_id)
            probs = processors.sampling_warp(self.ops, scores, segments).softmax(-1)
            picks = self.ops.sample_draw(probs, [seg.search.ctx.generator for seg in segments])
            logprobs = scores.log_softmax(-1).gather(1, picks[:, None])[:, 0]
            device_out += [picks.double(), logprobs.double()]
            next_parts.append((plan.sampled_index_t, picks, every_row))
        # 3. beam: top 2 x nb of (log-softmax, processors) per row, + the row's running score, then
        #    the top 2 x nb over the segment's nb x 2nb candidates (the same set as over nb x V)
        #    and the beam step on the device (engine/beam_step.py)
        for i, (step, (nb, group)) in enumerate(zip(steps, plan.beams.items())):
            k, b = 2 * nb, len(group.segments)
            values, tokens = self._beam_topk(logits, group, k)  # [B * nb, k] each
            top_scores, parents, tokens = self.ops.beam_candidates(values, tokens, row_scores,
                                                                   group.slot_rows_t.view(b, nb))
            kept = beam_step.device_step(self.ops, step, top_scores, parents, tokens, self.eos_id, history,
                                         row_scores, None if metas is None else metas[i])
            next_parts.append((group.index_t, kept, group.is_all(logits)))
            device_out += [top_scores.flatten().double(), parents.flatten(), tokens.flatten()]
        payload = torch.cat(device_out) if device_out else None
        if len(next_parts) == 1 and next_parts[0][2]:
            return payload, next_parts[0][1]
        fill = torch.zeros if plan.unstepped else torch.empty  # else every batch row is in one of the parts
        next_tokens = fill(logits.shape[0], dtype=torch.int64, device=logits.device)
        for index, tokens, _ in next_parts:
            next_tokens.index_copy_(0, index, tokens)
        return payload, next_tokens

    def _forced_beam_steps(self, plan: Plan, history: torch.Tensor, row_scores: torch.Tensor) -> list:
        """Beam segments at decoder length 1 take the beam step too, from the candidates HF's forced
        scores give (known on the host); returns (BeamStepInputs, scores, parents, tokens, (batch rows, next
        tokens on the device)) per beam width: the host arrays for `finish`, the next tokens for the batch."""
        widths: dict[int, list] = {}
        for seg, at in zip(plan.forced, plan.forced_at):
            if isinstance(seg.search, BeamSearch):
                widths.setdefault(seg.search.rows, []).append((seg, at))
        out = []
        for nb, members in widths.items():
            segs = [seg for seg, _ in members]
            forced_ids = np.fromiter((seg.search.ctx.forced_id for seg in segs), dtype=np.int64, count=len(segs))
            scores, parents, tokens = forced_candidates(nb, forced_ids, self.eos_id)
            step = self.beam_rows.step_inputs(segs, np.array([seg.rows for seg in segs], dtype=np.int64))
            on_device = (upload(a, history.device) for a in (scores, parents, tokens))
            kept = beam_step.device_step(self.ops, step, *on_device, self.eos_id, history, row_scores)
            batch_rows = (np.array([at for _, at in members], dtype=np.int64)[:, None] + np.arange(nb)).reshape(-1)
            out.append((step, scores.astype(np.float64), parents, tokens, (batch_rows, kept)))
        return out

    def finish(self, selection: "Selection", row_tokens: np.ndarray) -> StepOutcome:
        """Wait for a launched selection's result and decide on the host: write each row's next input
        token into row_tokens (indexed by slot row [R] int64) and return the outcome."""
        if selection.done is not None:
            selection.done.synchronize()
        return self._advance(selection, selection.host.numpy(), row_tokens)

    def _plan(self, segments: list, version: int, live: np.ndarray, positions: np.ndarray, modes: RowModes) -> Plan:
        plan = self.plan
        if plan is not None and plan.version == version:
            if self.steps < plan.valid_until:
                return plan
            if not plan.forced:
                self.plan = plan.with_bans(self.steps, self.device)
                return self.plan
        self.plan = build(segments, version, live, positions, modes, self.steps, self.device)
        return self.plan

    def _greedy_scores(self, logits: torch.Tensor, group: RowGroup) -> torch.Tensor:
        scores = group.gather(logits, self.ops)
        if group.processed:
            scores = scores.float()  # processed rows are written back unrounded
            processors.history_processors(self.ops, scores, group.processed, self.eos_id)
        if group.banned_t is not None:
            # index_fill_ takes the value as a scalar: `scores[rows, eos] = -inf` would copy it from the host
            # with a stream sync, which stops the next step from being queued while this one runs
            scores[:, self.eos_id].index_fill_(0, group.banned_t, float("-inf"))
        return scores

    def _beam_topk(self, logits: torch.Tensor, group: RowGroup, k: int):
        """Per row, the k best of log-softmax then processors: the fused kernel for all rows (</s> banned
        after the log-softmax, as HF does, where the segment bans it), then, for the rows of segments that use
        history processors, torch's log_softmax and topk around the processors op."""
        values, tokens = self.ops.topk_logprobs(group.gather(logits, self.ops), k, group.ban_mask_t, self.eos_id)
        if group.processed:
            logprobs = logits.index_select(0, group.processed_rows_t).float().log_softmax(-1)  # segment after segment
            nb = len(group.index) // len(group.segments)
            members = [(seg, i * nb) for i, (seg, _) in enumerate(group.processed)]
            processors.history_processors(self.ops, logprobs, members, self.eos_id)
            values[group.processed_at_t], tokens[group.processed_at_t] = torch.topk(logprobs, k)
        return values, tokens

    def _advance(self, selection: Selection, host: np.ndarray, row_tokens: np.ndarray) -> StepOutcome:
        plan, updates, pos = selection.plan, [], 0
        for segments, rows in ((plan.greedy.segments, plan.greedy.slot_rows), (plan.sampled, plan.sampled_rows)):
            n = len(segments)  # one row each
            if not n:
                continue
            tokens, logprobs = host[pos:pos + n].astype(np.int64), host[pos + n:pos + 2 * n]
            pos += 2 * n
            updates.append(RowPicks(segments, rows, tokens, logprobs))
            row_tokens[rows] = tokens
        for step in selection.beam_steps:
            size = step.rows.size * 2
            scores = host[pos:pos + size].reshape(-1, step.rows.shape[1] * 2)
            parents = host[pos + size:pos + 2 * size].astype(np.int64).reshape(scores.shape)
            tokens = host[pos + 2 * size:pos + 3 * size].astype(np.int64).reshape(scores.shape)
            pos += 3 * size
            updates.append(beam_step.host_step(step, scores, parents, tokens, self.eos_id, row_tokens))
        for step, scores, parents, tokens in selection.forced_beams:
            updates.append(beam_step.host_step(step, scores, parents, tokens, self.eos_id, row_tokens))
        self._advance_forced(plan.forced, selection.vocab, row_tokens, updates)
        return StepOutcome(updates)

    @staticmethod
    def _advance_forced(forced: list, vocab: int, row_tokens: np.ndarray, updates: list) -> None:
        """Decoder length 1, greedy and sampled segments: the row takes the forced language token (beam
        segments took the beam step at launch). A segment that left the table since the launch (its job
        cancelled or failed between steps) has no row to write: skipped."""
        segments = [seg for seg in forced if seg.rows and not isinstance(seg.search, BeamSearch)]
        if not segments:
            return
        for seg in segments:
            ctx = seg.search.ctx
            if ctx.generator is not None:  # HF draws at this step too: keep the streams aligned
                one_hot = processors.forced_scores(1, vocab, ctx.forced_id, ctx.generator.device)
                torch.multinomial(one_hot.softmax(-1), 1, generator=ctx.generator)
        rows = np.fromiter((seg.rows[0] for seg in segments), dtype=np.int64, count=len(segments))
        tokens = np.fromiter((seg.search.ctx.forced_id for seg in segments), dtype=np.int64, count=len(segments))
        updates.append(RowPicks(segments, rows, tokens, np.zeros(len(segments))))
        row_tokens[rows] = tokens
