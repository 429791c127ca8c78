"""Token selection for every live row of a step: batched on the device, bookkeeping vectorized on the host.

Per mode, in HF's order: greedy takes argmax of the processed logits; sampling warps them
(temperature, top-k, top-p) and draws with the segment's own generator; beam search takes
log-softmax, processors, adds each row's running score and keeps the top 2 x num_beams over
the segment's num_beams x V scores. All of it is batched across segments and comes back to the
host in ONE transfer. At decoder length 1 the forced language token needs no logits at all.

Host cost per step is what limits a large batch, so:
- what a step needs to know about its segments (mode, where their rows are, whether </s> is banned)
  only changes when segments come or go or cross a phase boundary (the forced first step, the end
  of min_new_tokens); it is planned once (`Plan`, with its device index tensors) and reused;
- beam search's per-step decisions (which candidates run on, their scores, the cache reorder) are
  taken for every segment of a beam width at once, on the device at launch and again in numpy when
  the host reads the candidates (engine/beam_step.py); a segment's own Python runs only to extend its
  hypotheses and, where a candidate finished, its finished set, later, while the next step runs.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from math import inf
from types import ModuleType

import numpy as np
import torch

from engine import processors
from engine import beam_step
from engine.beam_step import BeamStepInputs
from engine.devices import upload
from engine.search import BeamSearch
from engine.selection_graph import SelectionGraph


@dataclass
class StepOutcome:
    """What a step decided for the searches, which the engine applies later (while the next step runs):
    iterables of (segment, arguments of segment.search.advance), every segment of the step between them;
    beam groups' are generators, so their per-segment Python runs then too."""

    updates: list


@dataclass
class RowGroup:
    """The segments of one selection mode and where their rows are, with device copies of the indices."""

    members: list = field(default_factory=list)  # (segment, slice of its rows in the logits)
    index: list[int] = field(default_factory=list)  # the members' logits rows, in order
    ban_steps: list[int] = field(default_factory=list)  # per row of `index`: launches of the plan that ban </s> there
    processed: list = field(default_factory=list)  # (segment, position in `index`, its slice): history processors
    slot_rows: list[int] = field(default_factory=list)  # the members' slot-table rows, in order
    index_t: torch.Tensor | None = None  # device copies, made by `freeze`
    banned_t: torch.Tensor | None = None  # positions in `index` that ban </s> at this launch (None: none)
    ban_mask_t: torch.Tensor | None = None  # [len(index)] int64, 1 where the row bans </s> (topk_logprobs' ban)
    slot_rows_t: torch.Tensor | None = None
    slot_rows_np: np.ndarray | None = None
    ban_steps_np: np.ndarray | None = None
    processed_rows_t: torch.Tensor | None = None  # [rows of `processed`] int64: their logits rows, in order
    processed_at_t: torch.Tensor | None = None  # [rows of `processed`] int64: their positions in `index`

    def add(self, seg, start: int, rows: list[int]) -> None:
        """The segment whose logits rows start at `start`, at slot rows `rows`."""
        search, n = seg.search, seg.search.rows
        at = len(self.index)
        self.members.append((seg, slice(start, start + n)))
        self.index += range(start, start + n)
        self.slot_rows += rows
        if search.ctx.uses_history:  # the processors ban </s> themselves
            self.processed.append((seg, at, slice(start, start + n)))
            self.ban_steps += [0] * n
        else:
            self.ban_steps += [max(0, search.ctx.options.min_new_tokens - seg.steps)] * n

    def freeze(self, device: torch.device) -> None:
        """Make the device copies of the indices (once per plan)."""
        self.index_t = upload(np.array(self.index, dtype=np.int64), device)
        self.slot_rows_np = np.array(self.slot_rows, dtype=np.int64)
        self.slot_rows_t = upload(self.slot_rows_np, device)
        self.ban_steps_np = np.array(self.ban_steps, dtype=np.int64)
        self._set_bans(0, device)
        if self.processed:
            at = np.concatenate([np.arange(at, at + rows.stop - rows.start) for _, at, rows in self.processed])
            self.processed_at_t = upload(at, device)
            self.processed_rows_t = upload(np.array(self.index, dtype=np.int64)[at], device)

    def _set_bans(self, elapsed: int, device: torch.device) -> None:
        """The </s> bans at the plan's launch `elapsed` (0: its first): every member advances one step a launch."""
        mask = self.ban_steps_np > elapsed
        banned = np.flatnonzero(mask)
        self.banned_t = upload(banned, device) if banned.size else None
        self.ban_mask_t = upload(mask.astype(np.int64), device) if banned.size else None

    def with_bans(self, elapsed: int, device: torch.device) -> "RowGroup":
        """A copy of the group with its bans at launch `elapsed` (the plan's other tensors shared)."""
        if not self.index:
            return self
        group = copy.copy(self)
        group._set_bans(elapsed, device)
        return group

    def next_ban_change(self, elapsed: int) -> float:
        """The first launch after `elapsed` at which a row's ban ends (inf: none does)."""
        later = self.ban_steps_np[self.ban_steps_np > elapsed] if self.index else ()
        return int(later.min()) if len(later) else inf

    def is_all(self, logits: torch.Tensor) -> bool:
        """Whether the group's rows are all the logits rows, in order (they are distinct and increasing)."""
        return len(self.index) == logits.shape[0] and self.index[-1] == len(self.index) - 1

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """The group's rows in one gather (none when they are all rows, in order). Rows belong to
        one group only, so callers may edit them in place."""
        return logits if self.is_all(logits) else logits[self.index_t]


@dataclass
class Plan:
    """How the running segments split into selection modes; valid until `valid_until` (a launch count), when a
    segment's first step or its </s> ban ends."""

    version: int  # the scheduler's version of the running set it was made for
    made_at: int  # the Selector's launch count at its first launch
    valid_until: float
    greedy: RowGroup
    sampled: list  # (segment, slice of its row in the logits)
    sampled_rows: np.ndarray  # [len(sampled)] their slot rows (taken when planned: a segment may leave later)
    sampled_index_t: torch.Tensor | None  # [len(sampled)] int64 on the device: their logits rows
    beams: dict[int, RowGroup]  # num_beams -> group
    forced: list  # segments at decoder length 1 (no logits rows)
    # every logits row is greedy, sampled or beam and none is forced: the next step's inputs are then all
    # decided on the device (processors, </s> bans and draws act there, the beam step too), so the engine can
    # start the next step before the host reads this one's
    device_only: bool

    def groups(self) -> tuple[RowGroup, ...]:
        return (self.greedy, *self.beams.values())

    def until(self, elapsed: int) -> float:
        """valid_until for the plan's bans at launch `elapsed`: the next launch at which one ends."""
        if self.forced:
            return self.made_at + 1
        return self.made_at + min(group.next_ban_change(elapsed) for group in self.groups())

    def with_bans(self, steps: int, device: torch.device) -> "Plan":
        """The same plan at launch count `steps`, with only the </s> bans moved on: when a segment's ban ends,
        the rows stay where they were, so nothing is walked per segment (on ragged traffic that happens at
        nearly every step)."""
        elapsed = steps - self.made_at
        plan = replace(self, greedy=self.greedy.with_bans(elapsed, device),
                       beams={nb: group.with_bans(elapsed, device) for nb, group in self.beams.items()})
        plan.valid_until = plan.until(elapsed)
        return plan


@dataclass
class Selection:
    """A step's selection launched on the device (Selector.launch), its result not read on the host yet."""

    plan: Plan
    host: torch.Tensor  # float64 on the host (pinned, filled asynchronously): the step's one transfer
    done: torch.cuda.Event | None  # recorded after the transfer (None on the CPU: already done)
    vocab: int
    next_tokens: torch.Tensor | None  # [N] int64 on the device when plan.device_only: each row's next input
    beam_steps: list  # BeamStepInputs of each beam group, in plan order
    forced_beams: list  # (BeamStepInputs, scores, parents, tokens) host arrays of forced beam segments


class Selector:
    """Selection with its plan cache; one per engine, used by the engine thread only."""

    def __init__(self, eos_id: int, ops: ModuleType, device: torch.device, graphs: bool = False):
        """graphs: capture the device part of long-lived small plans (engine/selection_graph.py); CUDA
        kernels only."""
        self.eos_id, self.ops, self.device = eos_id, ops, device
        self.steps = 0
        self.plan: Plan | None = None
        self.graph = SelectionGraph() if graphs else None

    def launch(self, segments: list, version: int, live: np.ndarray, logits: torch.Tensor, row_scores: torch.Tensor,
               history: torch.Tensor) -> "Selection":
        """Every segment's next token chosen on the device, beams' cache reorder and running scores applied
        there, and the result's copy to the host started; `finish` reads it. The searches themselves
        advance when the engine applies the outcome's `updates`, which must happen before the next launch.
        Shape: live [N] int64, the segments' slot rows in order (as when the batch was made: a segment may
        have left since); logits [N', V] (model dtype; read as float32) for the rows of segments past step 0,
        in segment order; row_scores [R] float32 running beam score per slot row; history [R, T] int32."""
        plan = self._plan(segments, version, live)
        self.steps += 1
        steps = [BeamStepInputs.of([seg for seg, _ in group.members], group.slot_rows_np.reshape(-1, nb))
                 for nb, group in plan.beams.items()]
        replayed = None
        if self.graph is not None:
            replayed = self.graph.run(plan, logits, steps,
                                      lambda metas: self._on_device(plan, steps, logits, row_scores, history, metas))
        payload, next_tokens = replayed or self._on_device(plan, steps, logits, row_scores, history)
        forced_beams = self._forced_beam_steps(plan.forced, history, row_scores)
        # the one host transfer of the step, not waited for here
        host = payload.to("cpu", non_blocking=True) if payload is not None else torch.zeros(0, dtype=torch.double)
        done = None
        if logits.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return Selection(plan, host, done, logits.shape[-1], next_tokens, steps, forced_beams)

    def _on_device(self, plan: Plan, steps: list[BeamStepInputs], logits: torch.Tensor, row_scores: torch.Tensor,
                   history: torch.Tensor, metas: list[torch.Tensor] | None = None) -> tuple:
        """The step's selection on the device: (payload, next tokens). payload [P] float64 is what the host
        reads (float64 keeps token and beam indices exact; cat promotes the int64 parts to it), None when
        empty; next tokens [N] int64 when plan.device_only, else None. metas: each beam group's
        BeamStepInputs.meta on the device (None: uploaded here)."""
        device_out = []  # tensors fetched to the host together, in this order
        next_parts = []  # (logits rows, their next tokens, whether those rows are all rows in order) on the device
        # 1. greedy: argmax over the processed logits; the log-prob of the pick for the score
        if plan.greedy.index:
            tokens, logprobs = self.ops.greedy_select(self._greedy_scores(logits, plan.greedy))
            device_out += [tokens.double(), logprobs.double()]
            next_parts.append((plan.greedy.index_t, tokens, plan.greedy.is_all(logits)))
        # 2. sampling: processors and warpers batched; then torch.multinomial's own one-sample draw, argmax of
        #    probs / q with q ~ Exp(1) drawn from the segment's generator a row at a time (its seeded stream:
        #    same seed, same draw, in any batch, as HF's), the division and argmax batched; the log-prob is of
        #    the processed, unwarped scores, as HF scores it
        if plan.sampled:
            segments = [seg for seg, _ in plan.sampled]
            scores = logits[plan.sampled_index_t].float()
            processors.history_processors(self.ops, scores, [(seg, i) for i, seg in enumerate(segments)
                                                             if processors.acts_on(seg.search)], self.eos_id)
            probs = processors.sampling_warp(self.ops, scores, segments).softmax(-1)
            noise = torch.empty_like(probs)
            for i, seg in enumerate(segments):
                noise[i:i + 1].exponential_(1, generator=seg.search.ctx.generator)
            picks = torch.div(probs, noise, out=noise).argmax(-1)
            logprobs = scores.log_softmax(-1).gather(1, picks[:, None])[:, 0]
            device_out += [picks.double(), logprobs.double()]
            next_parts.append((plan.sampled_index_t, picks, len(segments) == logits.shape[0]))
        # 3. beam: top 2 x nb of (log-softmax, processors) per row, + the row's running score, then
        #    the top 2 x nb over the segment's nb x 2nb candidates (the same set as over nb x V)
        #    and the beam step on the device (engine/beam_step.py)
        for i, (step, (nb, group)) in enumerate(zip(steps, plan.beams.items())):
            k, b = 2 * nb, len(group.members)
            values, tokens = self._beam_topk(logits, group, k)  # [B * nb, k] each
            top_scores, parents, tokens = self.ops.beam_candidates(values, tokens, row_scores,
                                                                   group.slot_rows_t.view(b, nb))
            kept = beam_step.device_step(self.ops, step, top_scores, parents, tokens, self.eos_id, history,
                                         row_scores, None if metas is None else metas[i])
            next_parts.append((group.index_t, kept, group.is_all(logits)))
            device_out += [top_scores.flatten().double(), parents.flatten(), tokens.flatten()]
        payload = torch.cat(device_out) if device_out else None
        next_tokens = None
        if plan.device_only and len(next_parts) == 1 and next_parts[0][2]:
            next_tokens = next_parts[0][1]
        elif plan.device_only:  # every logits row is in one of next_parts
            next_tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
            for index, tokens, _ in next_parts:
                next_tokens.index_copy_(0, index, tokens)
        return payload, next_tokens

    def _forced_beam_steps(self, forced: list, history: torch.Tensor, row_scores: torch.Tensor) -> list:
        """Beam segments at decoder length 1 take the beam step too, from the candidates HF's forced
        scores give (known on the host); returns (BeamStepInputs, scores, parents, tokens) for `finish`."""
        widths: dict[int, list] = {}
        for seg in forced:
            if isinstance(seg.search, BeamSearch):
                widths.setdefault(seg.search.rows, []).append(seg)
        out = []
        for segs in widths.values():
            candidates = [seg.search.forced_candidates() for seg in segs]
            scores = np.array([c[0] for c in candidates], dtype=np.float32)
            parents = np.array([[parent for parent, _ in c[1]] for c in candidates], dtype=np.int64)
            tokens = np.array([[token for _, token in c[1]] for c in candidates], dtype=np.int64)
            step = BeamStepInputs.of(segs, np.array([seg.rows for seg in segs], dtype=np.int64))
            on_device = (upload(a, history.device) for a in (scores, parents, tokens))
            beam_step.device_step(self.ops, step, *on_device, self.eos_id, history, row_scores)
            out.append((step, scores.astype(np.float64), parents, tokens))
        return out

    def finish(self, selection: "Selection", row_tokens: np.ndarray) -> StepOutcome:
        """Wait for a launched selection's result and decide on the host: write each row's next input
        token into row_tokens (indexed by slot row [R] int64) and return the outcome."""
        if selection.done is not None:
            selection.done.synchronize()
        return self._advance(selection, selection.host.numpy(), row_tokens)

    def _plan(self, segments: list, version: int, live: np.ndarray) -> Plan:
        plan = self.plan
        if plan is not None and plan.version == version:
            if self.steps < plan.valid_until:
                return plan
            if not plan.forced:
                self.plan = plan.with_bans(self.steps, self.device)
                return self.plan
        greedy, sampled, sampled_rows, beams, forced = RowGroup(), [], [], {}, []
        offset = at = 0  # the segment's first logits row, its first row in `live`
        for seg in segments:
            search, n = seg.search, seg.search.rows
            rows, at = live[at:at + n].tolist(), at + n
            if seg.steps == 0:  # no logits rows
                if seg.rows:  # else it left the table before its first step
                    forced.append(seg)
                continue
            # a segment that left since the batch was made is planned like the others: its rows compute on, so
            # that the plan stays all on the device; the engine drops their picks
            if isinstance(search, BeamSearch):
                (beams.get(n) or beams.setdefault(n, RowGroup())).add(seg, offset, rows)
            elif search.ctx.options.do_sample:
                sampled.append((seg, slice(offset, offset + 1)))
                sampled_rows.append(rows[0])  # processors ban its </s> at each launch (acts_on)
            else:
                greedy.add(seg, offset, rows)
            offset += n
        for group in (greedy, *beams.values()):
            if group.index:
                group.freeze(self.device)
        device_only = not forced  # every logits row is in a group
        sampled_index = upload(np.array([rows.start for _, rows in sampled], dtype=np.int64), self.device)
        self.plan = Plan(version, self.steps, inf, greedy, sampled, np.array(sampled_rows, dtype=np.int64),
                         sampled_index if sampled else None, beams, forced, device_only)
        self.plan.valid_until = self.plan.until(0)
        return self.plan

    def _greedy_scores(self, logits: torch.Tensor, group: RowGroup) -> torch.Tensor:
        scores = group.gather(logits)
        if group.processed:
            scores = scores.float()  # processed rows are written back unrounded
            processors.history_processors(self.ops, scores, [(seg, at) for seg, at, _ in group.processed],
                                          self.eos_id)
        if group.banned_t is not None:
            # index_fill_ takes the value as a scalar: `scores[rows, eos] = -inf` would copy it from the host
            # with a stream sync, which stops the next step from being queued while this one runs
            scores[:, self.eos_id].index_fill_(0, group.banned_t, float("-inf"))
        return scores

    def _beam_topk(self, logits: torch.Tensor, group: RowGroup, k: int):
        """Per row, the k best of log-softmax then processors: the fused kernel for all rows (</s> banned
        after the log-softmax, as HF does, where the segment bans it), then, for the rows of segments that use
        history processors, torch's log_softmax and topk around the processors op."""
        values, tokens = self.ops.topk_logprobs(group.gather(logits), k, group.ban_mask_t, self.eos_id)
        if group.processed:
            logprobs = logits[group.processed_rows_t].float().log_softmax(-1)
            members, first = [], 0
            for seg, _, rows in group.processed:
                members.append((seg, first))
                first += rows.stop - rows.start
            processors.history_processors(self.ops, logprobs, members, self.eos_id)
            values[group.processed_at_t], tokens[group.processed_at_t] = torch.topk(logprobs, k)
        return values, tokens

    def _advance(self, selection: Selection, host: np.ndarray, row_tokens: np.ndarray) -> StepOutcome:
        plan, updates, pos = selection.plan, [], 0
        for members, rows in ((plan.greedy.members, plan.greedy.slot_rows_np), (plan.sampled, plan.sampled_rows)):
            n = sum(seg.search.rows for seg, _ in members)
            if not n:
                continue
            tokens, logprobs = host[pos:pos + n].astype(np.int64), host[pos + n:pos + 2 * n]
            pos += 2 * n
            updates.append(zip([seg for seg, _ in members], zip(tokens.tolist(), logprobs.tolist())))
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
        for seg in forced:
            search = seg.search
            if isinstance(search, BeamSearch) or not seg.rows:
                continue
            if search.ctx.generator is not None:  # HF draws at this step too: keep the streams aligned
                one_hot = processors.forced_scores(1, vocab, search.ctx.forced_id, search.ctx.generator.device)
                torch.multinomial(one_hot.softmax(-1), 1, generator=search.ctx.generator)
            updates.append([(seg, (search.ctx.forced_id, 0.0))])
            row_tokens[seg.rows[0]] = search.ctx.forced_id
