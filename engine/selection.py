"""Token selection for every live row of a step, batched on the device.

Per mode, in HF's order: greedy takes argmax of the processed logits; sampling warps them
(temperature, top-k, top-p) and draws with the segment's own generator; beam search takes
log-softmax, processors, adds each row's running score and keeps the top 2 x num_beams over
the segment's num_beams x V scores. All of it is batched across segments and comes back to the
host in ONE transfer; the per-segment bookkeeping then runs on the host (engine/search.py).
At decoder length 1 the forced language token needs no logits at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from engine import processors
from engine.search import BeamSearch


@dataclass
class Selection:
    """What a step decided, for the engine to apply to the slot table."""

    reorder_dst: list[int]  # slot rows whose hypothesis now continues another row's (beam reorder)
    reorder_src: list[int]  # the row each of them continues
    reorder_len: list[int]  # positions written so far by each (its history's valid prefix)
    beam_rows: list[int]  # rows whose running beam score changed
    beam_scores: list[float]  # their new running scores (float32 values)

    @property
    def reorder(self) -> tuple[list[int], list[int], list[int]]:
        return self.reorder_dst, self.reorder_src, self.reorder_len


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
    """The segments of one selection mode and where their rows are, built in one pass."""

    members: list = field(default_factory=list)  # (segment, slice of its rows in the logits)
    index: list[int] = field(default_factory=list)  # the members' logits rows, in order
    banned: list[int] = field(default_factory=list)  # positions in `index` whose segment bans </s>
    processed: list = field(default_factory=list)  # (segment, position in `index`, its slice): history processors

    def add(self, seg, start: int) -> None:
        search, n = seg.search, seg.search.rows
        at = len(self.index)
        self.members.append((seg, slice(start, start + n)))
        self.index += range(start, start + n)
        if search.ctx.uses_history:
            self.processed.append((seg, at, slice(start, start + n)))
        elif search.cur_len - 1 < search.ctx.options.min_new_tokens:
            self.banned += range(at, at + n)

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """The group's rows in one gather (none when they are all rows, in order). Rows belong to
        one group only, so callers may edit them in place."""
        if len(self.index) == logits.shape[0] and self.index[-1] == len(self.index) - 1:
            return logits  # rows are distinct and in increasing order, so this means all, in order
        return logits[torch.tensor(self.index, device=logits.device)]


def select(segments: list, logits: torch.Tensor, row_scores: torch.Tensor, eos_id: int,
           ops: ModuleType) -> Selection:
    """Advance every segment's search by one token.
    Shape: logits [N', V] (model dtype; read as float32) for the rows of segments past step 0, in segment order;
    row_scores [R] float32 running beam score per slot row. `ops`: kernels (greedy_select,
    topk_logprobs) of the backend."""
    greedy, sampled, beams, forced = RowGroup(), [], {}, []
    offset = 0
    for seg in segments:
        search = seg.search
        if seg.steps == 0:
            forced.append(seg)
            continue
        if isinstance(search, BeamSearch):
            (beams.get(search.rows) or beams.setdefault(search.rows, RowGroup())).add(seg, offset)
        elif search.ctx.options.do_sample:
            sampled.append((seg, slice(offset, offset + 1)))
        else:
            greedy.add(seg, offset)
        offset += search.rows
    device_out = []  # tensors fetched to the host together, in this order

    # 1. greedy: argmax over the processed logits; the log-prob of the pick for the score
    if greedy.index:
        tokens, logprobs = ops.greedy_select(_greedy_scores(logits, greedy, eos_id))
        device_out += [tokens.double(), logprobs.double()]
    # 2. sampling: each segment draws from its own generator (same seed, same draw, any batch)
    if sampled:
        picks, logprobs = [], []
        for seg, rows in sampled:
            scores = _processed(seg, logits[rows], eos_id)
            probs = processors.warp(seg.search.ctx.options, scores).softmax(-1)
            token = torch.multinomial(probs, 1, generator=seg.search.ctx.generator)[:, 0]
            picks.append(token)
            logprobs.append(scores.log_softmax(-1).gather(1, token[:, None])[:, 0])
        device_out += [torch.cat(picks).double(), torch.cat(logprobs).double()]
    # 3. beam: top 2 x nb of (log-softmax, processors) per row, + the row's running score, then
    #    the top 2 x nb over the segment's nb x 2nb candidates (the same set as over nb x V)
    for nb, group in beams.items():
        k, b = 2 * nb, len(group.members)
        values, tokens = _beam_topk(logits, group, k, eos_id, ops)  # [B * nb, k] each
        slot_rows = torch.tensor([r for seg, _ in group.members for r in seg.rows], device=logits.device)
        accumulated = (values + row_scores[slot_rows][:, None]).view(b, nb * k)
        top_scores, pos = torch.topk(accumulated, k)  # pos: beam * k + rank within the beam
        flat = (pos // k) * logits.shape[-1] + tokens.view(b, nb * k).gather(1, pos)
        device_out += [top_scores.flatten().double(), flat.flatten().double()]
    # the one host transfer of the step (float64 keeps token and beam indices exact)
    host = torch.cat(device_out).tolist() if device_out else []
    return _advance(greedy.members, sampled, {nb: g.members for nb, g in beams.items()}, forced, host,
                    logits.shape[-1])


def _greedy_scores(logits: torch.Tensor, group: RowGroup, eos_id: int) -> torch.Tensor:
    scores = group.gather(logits)
    if group.processed:
        scores = scores.float()  # processed rows are written back unrounded
    for seg, at, rows in group.processed:
        scores[at:at + rows.stop - rows.start] = _processed(seg, logits[rows], eos_id)
    if group.banned:
        scores[torch.tensor(group.banned, device=scores.device), eos_id] = float("-inf")
    return scores


def _beam_topk(logits: torch.Tensor, group: RowGroup, k: int, eos_id: int, ops: ModuleType):
    """Per row, the k best of log-softmax then processors: the fused kernel for all rows (one
    more than k where </s> is banned, then </s> dropped: HF bans it after the log-softmax), then
    torch's log_softmax, processors and topk for the rows of segments that use processors."""
    values, tokens = ops.topk_logprobs(group.gather(logits), k + 1 if group.banned else k)
    if group.banned:
        index = torch.tensor(group.banned, device=values.device)
        values[index] = values[index].masked_fill(tokens[index] == eos_id, float("-inf"))
        values, order = torch.topk(values, k)
        tokens = tokens.gather(1, order)
    for seg, at, rows in group.processed:
        n = rows.stop - rows.start
        logprobs = logits[rows].float().log_softmax(-1)
        values[at:at + n], tokens[at:at + n] = torch.topk(_processed(seg, logprobs, eos_id), k)
    return values, tokens


def _advance(greedy, sampled, beams, forced, host: list[float], vocab: int) -> Selection:
    sel = Selection([], [], [], [], [])
    pos = 0
    for group in (greedy, sampled):
        n = sum(seg.search.rows for seg, _ in group)
        tokens, logprobs = host[pos:pos + n], host[pos + n:pos + 2 * n]
        pos += 2 * n if group else 0
        for (seg, _), token, logprob in zip(group, tokens, logprobs):
            seg.search.advance(int(token), logprob)
    for nb, group in beams.items():
        k = 2 * nb
        scores, index = host[pos:pos + len(group) * k], host[pos + len(group) * k:pos + 2 * len(group) * k]
        pos += 2 * len(group) * k
        for g, (seg, _) in enumerate(group):
            top = [divmod(int(i), vocab) for i in index[g * k:(g + 1) * k]]
            _advance_beam(seg, scores[g * k:(g + 1) * k], top, sel)
    for seg in forced:
        search = seg.search
        if isinstance(search, BeamSearch):
            _advance_beam(seg, *search.forced_candidates(), sel)
        else:
            if search.ctx.generator is not None:  # HF draws at this step too: keep the streams aligned
                one_hot = processors.forced_scores(1, vocab, search.ctx.forced_id, search.ctx.generator.device)
                torch.multinomial(one_hot.softmax(-1), 1, generator=search.ctx.generator)
            search.advance(search.ctx.forced_id, 0.0)
    return sel


def _advance_beam(seg, scores: list[float], top: list[tuple[int, int]], sel: Selection) -> None:
    parents = seg.search.advance(scores, top)
    if parents != list(range(len(parents))):
        sel.reorder_dst += seg.rows
        sel.reorder_src += [seg.rows[p] for p in parents]
        sel.reorder_len += [seg.steps + 1] * len(parents)  # this step's position is written too
    sel.beam_rows += seg.rows
    sel.beam_scores += seg.search.running_scores


