"""Per-segment search state on the host: greedy/sampling (SingleSearch) and beam search.

The device work of a step (processors, argmax, sampling, top-k over num_beams x V) is batched
over all rows in engine/selection.py; what comes back to the host is a handful of numbers per
segment, and these classes do the bookkeeping with them in plain Python. Beam search follows HF
transformers' `_beam_search` exactly, its float32 arithmetic included (see `f32`).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from engine.options import GenerationOptions

EXCLUDED = -1.0e9  # HF's "never pick this" score offset


def f32(x: float) -> float:
    """Round to float32, as HF's float32 tensors do after every operation."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass
class SearchContext:
    """The per-segment constants every search needs."""

    options: GenerationOptions
    start_id: int  # decoder start token (</s> for NLLB)
    forced_id: int  # target-language token forced at decoder length 1
    eos_id: int
    max_length: int  # decoder sequence cap, the start token included (HF max_length)
    generator: torch.Generator | None  # sampling only: this segment's own seeded RNG


@dataclass
class Candidate:
    """A finished sequence. `ids` are the generated ids after the start token, </s> included."""

    ids: list[int]
    score: float


class SingleSearch:
    """Greedy (argmax) or sampling (multinomial on the warped distribution): one row."""

    rows = 1

    def __init__(self, ctx: SearchContext):
        self.ctx = ctx
        self.ids = [ctx.start_id]
        self.logprob = 0.0
        self.done = False

    def histories(self) -> list[list[int]]:
        """Each row's decoder sequence so far (what HF's processors see)."""
        return [self.ids]

    def next_tokens(self) -> list[int]:
        return [self.ids[-1]]

    def advance(self, token: int, logprob: float) -> None:
        self.ids.append(token)
        self.logprob += logprob
        self.done = token == self.ctx.eos_id or len(self.ids) >= self.ctx.max_length

    def results(self) -> list[Candidate]:
        generated = len(self.ids) - 1
        return [Candidate(self.ids[1:], self.logprob / generated ** self.ctx.options.length_penalty)]


class BeamSearch:
    """HF beam search for one segment. Each step keeps the top 2 x num_beams continuations (found
    on the device); those ending in </s> or at max_length among the first num_beams become
    finished hypotheses (sum log-prob / generated_len ** length_penalty), the best num_beams
    unfinished run on. early_stopping=True stops at num_beams finished; False when the best
    running beam, scored at the current length, cannot beat the worst finished one."""

    def __init__(self, ctx: SearchContext):
        nb = ctx.options.num_beams
        self.ctx = ctx
        self.rows = nb
        self.running = [[ctx.start_id] for _ in range(nb)]  # sequences of the live beams
        self.running_scores = [0.0] + [EXCLUDED] * (nb - 1)  # only beam 0 expands at first
        # the finished set: nb entries, best first; unfilled entries are HF's placeholders
        self.finished: list[tuple[float, list[int], bool]] = [(EXCLUDED, [ctx.start_id], False)] * nb
        self.can_improve = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False

    def histories(self) -> list[list[int]]:
        return self.running

    def next_tokens(self) -> list[int]:
        return [seq[-1] for seq in self.running]

    @property
    def cur_len(self) -> int:
        return len(self.running[0])

    def forced_candidates(self) -> tuple[list[float], list[tuple[int, int]]]:
        """The top 2 x nb at decoder length 1, where every beam's only finite token is the
        forced language token (log-prob 0): beam j's candidate scores its running score."""
        nb = self.rows
        scores = list(self.running_scores) + [float("-inf")] * nb
        return scores, [(j, self.ctx.forced_id) for j in range(nb)] + [(0, self.ctx.eos_id)] * nb

    def advance(self, top_scores: list[float], top: list[tuple[int, int]]) -> list[int]:
        """Consume the step's top 2 x nb (score, (parent beam, token)), best first; return the
        parent beam of each new running beam (the cache reorder)."""
        ctx, nb, t = self.ctx, self.rows, self.cur_len
        stops = [tok == ctx.eos_id or t + 1 >= ctx.max_length for _, tok in top]
        candidates = [self.running[parent] + [tok] for parent, tok in top]
        # 1. the best nb unfinished continuations run on
        run_scores = [f32(s + EXCLUDED) if stop else s for s, stop in zip(top_scores, stops)]
        keep = sorted(range(2 * nb), key=lambda k: -run_scores[k])[:nb]
        parents = [top[k][0] for k in keep]
        self.running = [candidates[k] for k in keep]
        self.running_scores = [run_scores[k] for k in keep]
        # 2. finished continuations among the top nb enter the finished set
        self._add_finished(top_scores, candidates, stops, t)
        # 3. stopping (HF: improvement possible, open beams left, valid continuations left)
        self._update_can_improve(t + 1)
        all_finished = all(done for _, _, done in self.finished)
        self.done = not self.can_improve or (all_finished and ctx.options.early_stopping) or all(stops)
        return parents

    def _add_finished(self, top_scores: list[float], candidates: list[list[int]], stops: list[bool],
                      generated_len: int) -> None:
        nb, opts = self.rows, self.ctx.options
        full = all(done for _, _, done in self.finished) and opts.early_stopping
        divisor = f32(generated_len ** opts.length_penalty)
        new = []
        for k, (score, seq, stop) in enumerate(zip(top_scores, candidates, stops)):
            just_finished = stop and k < nb
            value = f32(score / divisor)
            for excluded in (full, not self.can_improve, not just_finished):
                value = f32(value + (EXCLUDED if excluded else 0.0))
            new.append((value, seq, just_finished))
        merged = self.finished + new
        order = sorted(range(len(merged)), key=lambda k: -merged[k][0])[:nb]
        self.finished = [merged[k] for k in order]

    def _update_can_improve(self, cur_len: int) -> None:
        lp = self.ctx.options.length_penalty
        best_possible = f32(self.running_scores[0] / f32((cur_len - 1) ** lp))
        worst = min(score for score, _, _ in self.finished)
        improvable = any(best_possible > (worst if done else EXCLUDED) for _, _, done in self.finished)
        self.can_improve = self.can_improve and improvable

    def results(self) -> list[Candidate]:
        return [Candidate(seq[1:], score) for score, seq, _ in self.finished[:self.ctx.options.num_return_sequences]]


Search = SingleSearch | BeamSearch
