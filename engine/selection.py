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
  numpy operations over every segment of a beam width at once (`_advance_beams`); a segment's own
  Python runs only to extend its hypotheses and, where a candidate finished, its finished set.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import inf
from types import ModuleType
from typing import Iterator

import numpy as np
import torch

from engine import processors
from engine.search import EXCLUDED, BeamSearch


@dataclass
class StepOutcome:
    """What a step decided: for the slot table (numpy arrays, possibly empty) and, per segment, the
    arguments of its search's `advance`, which the engine applies later (while the next step runs)."""

    reorder_dst: np.ndarray  # [n] slot rows whose hypothesis now continues another row's (beam reorder)
    reorder_src: np.ndarray  # [n] the row each of them continues
    reorder_len: np.ndarray  # [n] positions written so far by each (its history's valid prefix)
    beam_rows: np.ndarray  # [m] rows whose running beam score changed
    beam_scores: np.ndarray  # [m] float32 their new running scores
    # iterables of (segment, arguments of segment.search.advance), every segment of the step between them;
    # beam groups' are generators, so their per-segment Python runs when the engine applies them, while the
    # next step runs on the device, not between this step's end and the next one's launch
    updates: list


def _processed(seg, scores: torch.Tensor, eos_id: int) -> torch.Tensor:
    """HF processors for one segment's rows (all of them, </s> ban included), in float32 as HF
    runs them on the upcast logits."""
    search, scores = seg.search, scores.float()
    if not search.ctx.uses_history and search.cur_len - 1 >= search.ctx.options.min_new_tokens:
        return scores
    ids = torch.tensor(search.histories(), device=scores.device)
    return processors.process(search.ctx.options, ids, scores, eos_id)


@dataclass
class RowGroup:
    """The segments of one selection mode and where their rows are, with device copies of the indices."""

    members: list = field(default_factory=list)  # (segment, slice of its rows in the logits)
    index: list[int] = field(default_factory=list)  # the members' logits rows, in order
    banned: list[int] = field(default_factory=list)  # positions in `index` whose segment bans </s>
    processed: list = field(default_factory=list)  # (segment, position in `index`, its slice): history processors
    slot_rows: list[int] = field(default_factory=list)  # the members' slot-table rows, in order
    index_t: torch.Tensor | None = None  # device copies, made by `freeze`
    banned_t: torch.Tensor | None = None
    slot_rows_t: torch.Tensor | None = None
    slot_rows_np: np.ndarray | None = None

    def add(self, seg, start: int) -> None:
        search, n = seg.search, seg.search.rows
        at = len(self.index)
        self.members.append((seg, slice(start, start + n)))
        self.index += range(start, start + n)
        self.slot_rows += seg.rows
        if search.ctx.uses_history:
            self.processed.append((seg, at, slice(start, start + n)))
        elif seg.steps < search.ctx.options.min_new_tokens:
            self.banned += range(at, at + n)

    def freeze(self, device: torch.device) -> None:
        """Make the device copies of the indices (once per plan)."""
        self.index_t = torch.tensor(self.index, dtype=torch.long).to(device)
        self.banned_t = torch.tensor(self.banned, dtype=torch.long).to(device) if self.banned else None
        self.slot_rows_np = np.array(self.slot_rows, dtype=np.int64)
        self.slot_rows_t = torch.from_numpy(self.slot_rows_np).to(device)

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """The group's rows in one gather (none when they are all rows, in order). Rows belong to
        one group only, so callers may edit them in place."""
        if len(self.index) == logits.shape[0] and self.index[-1] == len(self.index) - 1:
            return logits  # rows are distinct and in increasing order, so this means all, in order
        return logits[self.index_t]


@dataclass
class Plan:
    """How the running segments split into selection modes; valid until `valid_until` (a step count)."""

    version: int  # the scheduler's version of the running set it was made for
    valid_until: float
    greedy: RowGroup
    sampled: list  # (segment, slice of its row in the logits)
    sampled_rows: np.ndarray  # [len(sampled)] their slot rows (taken when planned: a segment may leave later)
    beams: dict[int, RowGroup]  # num_beams -> group
    forced: list  # segments at decoder length 1 (no logits rows)
    # every logits row is greedy, in order: the next step's input tokens are the picks themselves (processors
    # and </s> bans act on the device before them), so the engine can start the next step before the host
    # reads them
    device_only: bool


@dataclass
class Selection:
    """A step's selection launched on the device (Selector.launch), its result not read on the host yet."""

    plan: Plan
    host: torch.Tensor  # float64 on the host (pinned, filled asynchronously): the step's one transfer
    done: torch.cuda.Event | None  # recorded after the transfer (None on the CPU: already done)
    vocab: int
    next_tokens: torch.Tensor | None  # [N] int64 on the device when plan.device_only: each row's next input


class Selector:
    """Selection with its plan cache; one per engine, used by the engine thread only."""

    def __init__(self, eos_id: int, ops: ModuleType, device: torch.device):
        self.eos_id, self.ops, self.device = eos_id, ops, device
        self.steps = 0
        self.plan: Plan | None = None

    def launch(self, segments: list, version: int, logits: torch.Tensor, row_scores: torch.Tensor) -> "Selection":
        """Every segment's next token (and beam reorder) chosen on the device, and the result's copy to the
        host started; `finish` reads it. The searches themselves advance when the engine applies the
        outcome's `updates`, which must happen before the next launch.
        Shape: logits [N', V] (model dtype; read as float32) for the rows of segments past step 0, in
        segment order; row_scores [R] float32 running beam score per slot row."""
        plan = self._plan(segments, version)
        self.steps += 1
        device_out = []  # tensors fetched to the host together, in this order
        next_tokens = None
        # 1. greedy: argmax over the processed logits; the log-prob of the pick for the score
        if plan.greedy.index:
            tokens, logprobs = self.ops.greedy_select(self._greedy_scores(logits, plan.greedy))
            device_out += [tokens.double(), logprobs.double()]
            if plan.device_only:
                next_tokens = tokens
        # 2. sampling: each segment draws from its own generator (same seed, same draw, any batch)
        if plan.sampled:
            picks, logprobs = [], []
            for seg, rows in plan.sampled:
                scores = _processed(seg, logits[rows], self.eos_id)
                probs = processors.warp(seg.search.ctx.options, scores).softmax(-1)
                token = torch.multinomial(probs, 1, generator=seg.search.ctx.generator)[:, 0]
                picks.append(token)
                logprobs.append(scores.log_softmax(-1).gather(1, token[:, None])[:, 0])
            device_out += [torch.cat(picks).double(), torch.cat(logprobs).double()]
        # 3. beam: top 2 x nb of (log-softmax, processors) per row, + the row's running score, then
        #    the top 2 x nb over the segment's nb x 2nb candidates (the same set as over nb x V)
        for nb, group in plan.beams.items():
            k, b = 2 * nb, len(group.members)
            values, tokens = self._beam_topk(logits, group, k)  # [B * nb, k] each
            accumulated = (values + row_scores[group.slot_rows_t][:, None]).view(b, nb * k)
            top_scores, pos = torch.topk(accumulated, k)  # pos: beam * k + rank within the beam
            flat = (pos // k) * logits.shape[-1] + tokens.view(b, nb * k).gather(1, pos)
            device_out += [top_scores.flatten().double(), flat.flatten().double()]
        # the one host transfer of the step (float64 keeps token and beam indices exact), not waited for here
        host = torch.cat(device_out).to("cpu", non_blocking=True) if device_out else torch.zeros(0, dtype=torch.double)
        done = None
        if logits.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return Selection(plan, host, done, logits.shape[-1], next_tokens)

    def finish(self, selection: "Selection", row_tokens: np.ndarray) -> StepOutcome:
        """Wait for a launched selection's result and decide on the host: write each row's next input
        token into row_tokens (indexed by slot row [R] int64) and return the outcome."""
        if selection.done is not None:
            selection.done.synchronize()
        return self._advance(selection.plan, selection.host.numpy(), selection.vocab, row_tokens)

    def _plan(self, segments: list, version: int) -> Plan:
        plan = self.plan
        if plan is not None and plan.version == version and self.steps < plan.valid_until:
            return plan
        greedy, sampled, sampled_rows, beams, forced = RowGroup(), [], [], {}, []
        offset, horizon = 0, inf  # horizon: steps until some segment changes phase
        for seg in segments:
            search = seg.search
            gone = not seg.rows  # left the table after the batch was built (finished or failed): skip it
            if seg.steps == 0:
                if not gone:
                    forced.append(seg)
                    horizon = 1
                continue
            if gone:
                offset += search.rows  # its rows are still in the logits
                continue
            if seg.steps < search.ctx.options.min_new_tokens:
                horizon = min(horizon, search.ctx.options.min_new_tokens - seg.steps)
            if isinstance(search, BeamSearch):
                (beams.get(search.rows) or beams.setdefault(search.rows, RowGroup())).add(seg, offset)
            elif search.ctx.options.do_sample:
                sampled.append((seg, slice(offset, offset + 1)))
                sampled_rows.append(seg.rows[0])
            else:
                greedy.add(seg, offset)
            offset += search.rows
        for group in (greedy, *beams.values()):
            if group.index:
                group.freeze(self.device)
        device_only = not (sampled or beams or forced) and len(greedy.index) == offset
        self.plan = Plan(version, self.steps + horizon, greedy, sampled, np.array(sampled_rows, dtype=np.int64),
                         beams, forced, device_only)
        return self.plan

    def _greedy_scores(self, logits: torch.Tensor, group: RowGroup) -> torch.Tensor:
        scores = group.gather(logits)
        if group.processed:
            scores = scores.float()  # processed rows are written back unrounded
        for seg, at, rows in group.processed:
            scores[at:at + rows.stop - rows.start] = _processed(seg, logits[rows], self.eos_id)
        if group.banned_t is not None:
            # index_fill_ takes the value as a scalar: `scores[rows, eos] = -inf` would copy it from the host
            # with a stream sync, which stops the next step from being queued while this one runs
            scores[:, self.eos_id].index_fill_(0, group.banned_t, float("-inf"))
        return scores

    def _beam_topk(self, logits: torch.Tensor, group: RowGroup, k: int):
        """Per row, the k best of log-softmax then processors: the fused kernel for all rows (one
        more than k where </s> is banned, then </s> dropped: HF bans it after the log-softmax), then
        torch's log_softmax, processors and topk for the rows of segments that use processors."""
        values, tokens = self.ops.topk_logprobs(group.gather(logits), k + 1 if group.banned else k)
        if group.banned_t is not None:
            index = group.banned_t
            values[index] = values[index].masked_fill(tokens[index] == self.eos_id, float("-inf"))
            values, order = torch.topk(values, k)
            tokens = tokens.gather(1, order)
        for seg, at, rows in group.processed:
            n = rows.stop - rows.start
            logprobs = logits[rows].float().log_softmax(-1)
            values[at:at + n], tokens[at:at + n] = torch.topk(_processed(seg, logprobs, self.eos_id), k)
        return values, tokens

    def _advance(self, plan: Plan, host: np.ndarray, vocab: int, row_tokens: np.ndarray) -> StepOutcome:
        parts: list[tuple[np.ndarray, ...]] = []  # (dst, src, len, beam rows, beam scores) per beam group
        updates: list = []
        pos = 0
        for members, rows in ((plan.greedy.members, plan.greedy.slot_rows_np), (plan.sampled, plan.sampled_rows)):
            n = sum(seg.search.rows for seg, _ in members)
            if not n:
                continue
            tokens, logprobs = host[pos:pos + n].astype(np.int64), host[pos + n:pos + 2 * n]
            pos += 2 * n
            updates.append(zip([seg for seg, _ in members], zip(tokens.tolist(), logprobs.tolist())))
            row_tokens[rows] = tokens
        for nb, group in plan.beams.items():
            size = len(group.members) * 2 * nb
            scores = host[pos:pos + size].reshape(-1, 2 * nb)
            flat = host[pos + size:pos + 2 * size].astype(np.int64).reshape(-1, 2 * nb)
            pos += 2 * size
            segs = [seg for seg, _ in group.members]
            parts.append(_advance_beams(segs, group.slot_rows_np.reshape(-1, nb), scores, flat, vocab, row_tokens,
                                        updates))
        parts += self._advance_forced(plan.forced, vocab, row_tokens, updates)
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return StepOutcome(empty, empty, empty, empty, np.zeros(0, dtype=np.float32), updates)
        return StepOutcome(*(np.concatenate(column) for column in zip(*parts)), updates)

    def _advance_forced(self, forced: list, vocab: int, row_tokens: np.ndarray,
                        updates: list) -> list[tuple[np.ndarray, ...]]:
        """Decoder length 1: every row takes the forced language token (beam groups through the same
        vectorized step as later ones, with the candidates HF's forced scores give)."""
        parts, beams = [], {}
        for seg in forced:
            search = seg.search
            if isinstance(search, BeamSearch):
                beams.setdefault(search.rows, []).append(seg)
                continue
            if search.ctx.generator is not None:  # HF draws at this step too: keep the streams aligned
                one_hot = processors.forced_scores(1, vocab, search.ctx.forced_id, search.ctx.generator.device)
                torch.multinomial(one_hot.softmax(-1), 1, generator=search.ctx.generator)
            updates.append([(seg, (search.ctx.forced_id, 0.0))])
            row_tokens[seg.rows[0]] = search.ctx.forced_id
        for nb, segs in beams.items():
            candidates = [seg.search.forced_candidates() for seg in segs]
            scores = np.array([c[0] for c in candidates], dtype=np.float64)
            flat = np.array([[parent * vocab + token for parent, token in c[1]] for c in candidates], dtype=np.int64)
            rows = np.array([seg.rows for seg in segs], dtype=np.int64)
            parts.append(_advance_beams(segs, rows, scores, flat, vocab, row_tokens, updates))
        return parts


def _advance_beams(segs: list, rows: np.ndarray, scores: np.ndarray, flat: np.ndarray, vocab: int,
                   row_tokens: np.ndarray, updates: list) -> tuple[np.ndarray, ...]:
    """One HF beam step for B segments of num_beams nb, from each one's top 2 x nb candidates (best
    first): candidates ending in </s> or at max_length are stopped; the best nb unstopped run on
    (stopped ones, at -1e9, only as filler); stopped ones among the top nb are offered to the
    segment's finished set (a generator of each segment's advance arguments appended to `updates`, run
    when the engine applies them).
    Shape: rows [B, nb] slot rows; scores [B, 2nb] float64 (float32 values); flat [B, 2nb] int64
    (parent beam * V + token). Returns (reorder dst, src, len, beam rows, beam scores)."""
    nb = rows.shape[1]
    eos = segs[0].search.ctx.eos_id
    parents, tokens = np.divmod(flat, vocab)
    cur_len = np.fromiter((seg.search.cur_len for seg in segs), dtype=np.int64, count=len(segs))
    max_length = np.fromiter((seg.search.ctx.max_length for seg in segs), dtype=np.int64, count=len(segs))
    stops = (tokens == eos) | (cur_len + 1 >= max_length)[:, None]
    keep = np.argsort(stops, axis=1, kind="stable")[:, :nb]  # unstopped first, each part best first
    kept_parents = np.take_along_axis(parents, keep, 1)
    kept_tokens = np.take_along_axis(tokens, keep, 1)
    kept_scores = np.take_along_axis(scores, keep, 1)
    stopped_score = (kept_scores.astype(np.float32) + np.float32(EXCLUDED)).astype(np.float64)  # HF's f32 add
    kept_scores = np.where(np.take_along_axis(stops, keep, 1), stopped_score, kept_scores)
    updates.append(_beam_updates(segs, kept_parents, kept_tokens, kept_scores, stops, scores, parents, tokens))
    row_tokens[rows] = kept_tokens
    moved = (kept_parents != np.arange(nb)).any(1)
    dst = rows[moved].ravel()
    src = np.take_along_axis(rows, kept_parents, 1)[moved].ravel()
    length = np.repeat(cur_len[moved], nb)  # this step's position is written too
    return dst, src, length, rows.ravel(), kept_scores.astype(np.float32).ravel()


def _beam_updates(segs: list, kept_parents: np.ndarray, kept_tokens: np.ndarray, kept_scores: np.ndarray,
                  stops: np.ndarray, scores: np.ndarray, parents: np.ndarray, tokens: np.ndarray
                  ) -> Iterator[tuple]:
    """Yield (segment, BeamSearch.advance arguments) for each of _advance_beams' segments: the kept
    parents, tokens and scores, the finished candidates offered (None if none) and whether all stopped.
    Shape: kept_* [B, nb]; stops, scores, parents, tokens [B, 2nb]."""
    nb = kept_parents.shape[1]
    offered = stops[:, :nb]
    any_offered, all_stopped = offered.any(1).tolist(), stops.all(1).tolist()
    for b, (seg, p, t, s) in enumerate(zip(segs, kept_parents.tolist(), kept_tokens.tolist(), kept_scores.tolist())):
        finished = None
        if any_offered[b]:
            finished = [(float(scores[b, j]), int(parents[b, j]), int(tokens[b, j]))
                        for j in range(nb) if offered[b, j]]
        yield seg, (p, t, s, finished, all_stopped[b])
