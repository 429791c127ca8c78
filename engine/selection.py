"""Token selection for every live row of a step, batched on the device.

Per mode, in HF's order: greedy takes argmax of the processed logits; sampling warps them
(temperature, top-k, top-p) and draws with the segment's own generator; beam search takes
log-softmax, processors, adds each row's running score and keeps the top 2 x num_beams over
the segment's num_beams x V scores. All of it is batched across segments and comes back to the
host in ONE transfer; the per-segment bookkeeping then runs on the host (engine/search.py).
At decoder length 1 the forced language token needs no logits at all.
"""
from __future__ import annotations

from dataclasses import dataclass
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


def _uses_processors(seg) -> bool:
    """Repetition penalty or no-repeat n-grams: these need the segment's history (per segment)."""
    opts = seg.search.ctx.options
    return opts.repetition_penalty != 1.0 or opts.no_repeat_ngram_size > 0


def _bans_eos(seg) -> bool:
    """min_new_tokens not reached yet: </s> is -inf (batched over segments, see `_gather`)."""
    return seg.search.cur_len - 1 < seg.search.ctx.options.min_new_tokens


def _processed(seg, scores: torch.Tensor, eos_id: int) -> torch.Tensor:
    """HF processors for one segment's rows, when its options use any."""
    if not _uses_processors(seg) and not _bans_eos(seg):
        return scores
    ids = torch.tensor(seg.search.histories(), device=scores.device)
    return processors.process(seg.search.ctx.options, ids, scores, eos_id)


def select(segments: list, logits: torch.Tensor, row_scores: torch.Tensor, eos_id: int,
           ops: ModuleType) -> Selection:
    """Advance every segment's search by one token.
    Shape: logits [N', V] float32 for the rows of segments past step 0, in segment order;
    row_scores [R] float32 running beam score per slot row. `ops`: kernels (greedy_select,
    topk_logprobs) of the backend."""
    greedy, sampled, beams, forced = [], [], {}, []
    offset = 0
    for seg in segments:
        if seg.steps == 0:
            forced.append(seg)
            continue
        n = seg.search.rows
        rows = slice(offset, offset + n)
        offset += n
        if isinstance(seg.search, BeamSearch):
            beams.setdefault(n, []).append((seg, rows))
        elif seg.search.ctx.options.do_sample:
            sampled.append((seg, rows))
        else:
            greedy.append((seg, rows))
    device_out = []  # tensors fetched to the host together, in this order

    # 1. greedy: argmax over the processed logits; the log-prob of the pick for the score
    if greedy:
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
        k = 2 * nb
        values, tokens = _beam_topk(logits, group, k, eos_id, ops)  # [B * nb, k] each
        slot_rows = torch.tensor([r for seg, _ in group for r in seg.rows], device=logits.device)
        accumulated = (values + row_scores[slot_rows][:, None]).view(len(group), nb * k)
        top_scores, pos = torch.topk(accumulated, k)  # pos: beam * k + rank within the beam
        flat = (pos // k) * logits.shape[-1] + tokens.view(len(group), nb * k).gather(1, pos)
        device_out += [top_scores.flatten().double(), flat.flatten().double()]
    # the one host transfer of the step (float64 keeps token and beam indices exact)
    host = torch.cat(device_out).tolist() if device_out else []
    return _advance(greedy, sampled, beams, forced, host, logits.shape[-1])


def _gather(logits: torch.Tensor, group: list, fn) -> torch.Tensor:
    """The group's rows of `logits` in one gather (no copy when they are all rows, in order);
    rows of segments that use processors are replaced by fn(seg, their rows). Rows belong to one
    group only, so they may be edited in place."""
    index = [r for _, rows in group for r in range(rows.start, rows.stop)]
    out = logits if index == list(range(logits.shape[0])) else logits[torch.tensor(index, device=logits.device)]
    at = 0
    for seg, rows in group:
        n = rows.stop - rows.start
        if _uses_processors(seg):
            out[at:at + n] = fn(seg, logits[rows])
        at += n
    return out


def _eos_banned_rows(group: list) -> list[int]:
    """Positions, within the group's gathered rows, of rows whose segment still bans </s>."""
    at, banned = 0, []
    for seg, rows in group:
        n = rows.stop - rows.start
        if _bans_eos(seg) and not _uses_processors(seg):  # processors already masked those
            banned += range(at, at + n)
        at += n
    return banned


def _greedy_scores(logits: torch.Tensor, group: list, eos_id: int) -> torch.Tensor:
    scores = _gather(logits, group, lambda seg, x: _processed(seg, x, eos_id))
    banned = _eos_banned_rows(group)
    if banned:
        scores[torch.tensor(banned, device=scores.device), eos_id] = float("-inf")
    return scores


def _beam_topk(logits: torch.Tensor, group: list, k: int, eos_id: int, ops: ModuleType):
    """Per row, the k best of log-softmax then processors: the fused kernel for all rows (one
    more than k where </s> is banned, then </s> dropped: HF bans it after the log-softmax), then
    torch's log_softmax, processors and topk for the rows of segments that use processors."""
    banned = _eos_banned_rows(group)
    values, tokens = ops.topk_logprobs(_gather(logits, group, lambda seg, x: x), k + 1 if banned else k)
    if banned:
        index = torch.tensor(banned, device=values.device)
        values[index] = values[index].masked_fill(tokens[index] == eos_id, float("-inf"))
        values, order = torch.topk(values, k)
        tokens = tokens.gather(1, order)
    at = 0
    for seg, rows in group:
        n = rows.stop - rows.start
        if _uses_processors(seg):
            values[at:at + n], tokens[at:at + n] = torch.topk(_processed(seg, logits[rows].log_softmax(-1), eos_id), k)
        at += n
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


