"""Beam search's host state: every admitted beam segment's hypotheses and stopping state in one table by slot row
(BeamRows), which a step's decisions update for all segments of a beam width at once; and each segment's own face
(BeamSearch): its finished set and its results.

It follows HF transformers' `_beam_search` exactly, its float32 arithmetic included (engine/search.py `f32`): a
segment keeps its top 2 x num_beams continuations a step (found on the device, decided in engine/beam_step.py);
those ending in </s> or at max_length among the first num_beams become finished hypotheses (sum log-prob /
generated_len ** length_penalty), the best num_beams unfinished run on. early_stopping=True stops at num_beams
finished; False when the best running beam, scored at the current length, cannot beat the worst finished one.

HF keeps every candidate in its float32 tensors and lets excluded ones (score - 1e9) compete with the -1e9
placeholders of the finished set; in float32 those round to -1e9 and are interchangeable placeholders, so only
real finished hypotheses are tracked here.

Legend: R slot rows, T decoder positions, B segments of one step's beam width, nb beams.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from engine.beam_step import BeamPicks, BeamStepInputs
from engine.search import HISTORY, Candidate, SearchContext, f32, length_norm
from kernels.reference_selection import EXCLUDED  # HF's "never pick this" score offset


@lru_cache(maxsize=64)
def length_norms(length_penalty: float, lengths: int) -> np.ndarray:
    """length_norm(t) for t in 0..lengths-1: [lengths] float64 (float32 values), for a whole step's divisions (no
    hypothesis is ever 0 long: that entry is 1)."""
    return np.array([1.0] + [length_norm(t, length_penalty) for t in range(1, lengths)], dtype=np.float64)


class BeamRows:
    """The admitted beam segments' hypotheses by slot row, and each segment's step state by its head row (its
    first), so that one step's decisions apply to every segment of a beam width in one numpy pass (`advance`),
    where a Python method call a segment took ~7.5 us a segment a step on the 2-core machine, a third of the
    engine thread's time on the GPU machine's arrival stream."""

    def __init__(self, max_len: int, max_length: np.ndarray):
        """max_length [R]: each row's search's max_length, written by whoever admits the rows (the engine's step
        inputs, as for SingleRows)."""
        rows = max_length.shape[0]
        self.max_length = max_length
        self.ids = np.zeros((rows, max_len), dtype=np.int32)  # [R, T] each row's hypothesis, decoder start first
        # by head row [R]:
        self.cur_len = np.ones(rows, dtype=np.int64)  # the hypotheses' length so far
        self.can_improve = np.ones(rows, dtype=bool)  # HF's is_early_stop_heuristic_unsatisfied
        self.finished = np.zeros(rows, dtype=np.int64)  # finished hypotheses held (<= nb)
        self.worst = np.full(rows, EXCLUDED)  # float64: the worst finished score, once nb are held
        self.length_penalty = np.ones(rows)
        self.early_stopping = np.zeros(rows, dtype=bool)

    def start(self, searches: list["BeamSearch"], rows: list[list[int]]) -> None:
        """Admitted searches begin: each binds its rows, every hypothesis the decoder start alone."""
        for search, r in zip(searches, rows):
            search.bind(self, r)
        heads = np.array([r[0] for r in rows], dtype=np.int64)
        every = np.fromiter((x for r in rows for x in r), dtype=np.int64)
        self.ids[every, 0] = np.repeat([s.ctx.start_id for s in searches], [len(r) for r in rows])
        self.cur_len[heads], self.can_improve[heads], self.finished[heads], self.worst[heads] = 1, True, 0, EXCLUDED
        self.length_penalty[heads] = [s.ctx.options.length_penalty for s in searches]
        self.early_stopping[heads] = [s.ctx.options.early_stopping for s in searches]

    def step_inputs(self, segments: list, rows: np.ndarray) -> BeamStepInputs:
        """What both halves of a step read for these segments. Shape: rows [B, nb] int64 slot rows."""
        heads = rows[:, 0]
        cur_len = self.cur_len[heads]
        return BeamStepInputs(segments, rows, cur_len, cur_len + 1 >= self.max_length[heads])

    def advance(self, picks: BeamPicks, running: np.ndarray) -> np.ndarray:
        """Apply one step's decisions (engine/beam_step.py host_step) to the segments still running; returns the
        positions in picks.step.segments of those now done. Shape: running [B] bool.
        1. stopped candidates among the top nb enter their segment's finished set (a segment's own Python: a
        step offers few); 2. each beam continues its parent's hypothesis with its kept token; 3. HF's stopping
        test, in float32 as HF rounds it."""
        at = np.flatnonzero(running)
        rows = picks.step.rows[at]  # [B', nb]
        heads, t = rows[:, 0], picks.step.cur_len[at]
        nb = rows.shape[1]
        norm = self._norms(heads, t)
        # 1.
        offered = picks.stops[at, :nb]
        takes = offered.any(1) & self.can_improve[heads] & ~((self.finished[heads] == nb) & self.early_stopping[heads])
        for i in np.flatnonzero(takes).tolist():
            self._offer(picks, int(at[i]), rows[i], int(t[i]), float(norm[i]))
        # 2.
        width = int(t.max()) if t.size else 0
        parent_rows = np.take_along_axis(rows, picks.kept_parents[at], 1)
        self.ids[rows, :width] = self.ids[parent_rows, :width]  # the right side is a copy: no beam reads its own
        self.ids[rows, t[:, None]] = picks.kept_tokens[at]
        self.cur_len[heads] = t + 1
        # 3. f32(a / b) as float64 then float32 is float32's own division: a double's 53 bits round it once
        best = (picks.kept_scores[at, 0] / norm).astype(np.float32).astype(np.float64)
        bar = np.where(self.finished[heads] < nb, EXCLUDED, self.worst[heads])
        self.can_improve[heads] &= best > bar
        done = (~self.can_improve[heads] | ((self.finished[heads] == nb) & self.early_stopping[heads])
                | picks.stops[at].all(1))
        return at[done]

    def _norms(self, heads: np.ndarray, t: np.ndarray) -> np.ndarray:
        """length_norm(t) per segment [B'] float64, a lookup per distinct length_penalty."""
        penalty = self.length_penalty[heads]
        if penalty.size and (penalty == 1.0).all():
            return t.astype(np.float64)  # t ** 1.0, exact in float32 for any length that fits a row
        out = np.empty(t.size)
        for lp in np.unique(penalty).tolist():
            mine = penalty == lp
            out[mine] = length_norms(lp, self.ids.shape[1] + 1)[t[mine]]
        return out

    def _offer(self, picks: BeamPicks, b: int, rows: np.ndarray, t: int, norm: float) -> None:
        """Segment b's stopped candidates among its top nb, best first, into its finished set: each the parent's
        hypothesis (as it stood before this step) with the stopping token."""
        search: BeamSearch = picks.step.segments[b].search
        for j in np.flatnonzero(picks.stops[b, :rows.size]).tolist():
            parent = int(rows[picks.parents[b, j]])
            sequence = self.ids[parent, :t].tolist() + [int(picks.tokens[b, j])]
            search.add_finished(f32(float(picks.scores[b, j]) / norm), sequence)
        head = rows[0]
        self.finished[head] = len(search.finished)
        if len(search.finished) == rows.size:
            self.worst[head] = search.finished[-1][0]


class BeamSearch:
    """One beam segment. While admitted its hypotheses and stopping state live in the engine's BeamRows (`bind`),
    which a step advances for every segment at once; this object keeps its finished set, and once done its own
    length."""

    def __init__(self, ctx: SearchContext):
        nb = ctx.options.num_beams
        self.ctx = ctx
        self.rows = nb
        self.plan_code = nb << 2 | (HISTORY if ctx.uses_history else 0)
        self.finished: list[tuple[float, list[int]]] = []  # (score, whole sequence): real finished ones, best first
        self.done = False
        self.table: BeamRows | None = None
        self.slot_rows: list[int] = []
        self._cur_len = 1  # before admission and once done

    def bind(self, table: BeamRows, rows: list[int]) -> None:
        self.table, self.slot_rows = table, rows

    def end(self) -> None:
        """Done (the table said so): its rows are freed from now on."""
        self._cur_len = self.cur_len
        self.done, self.table = True, None

    @property
    def cur_len(self) -> int:
        return int(self.table.cur_len[self.slot_rows[0]]) if self.table is not None else self._cur_len

    def histories(self) -> list[list[int]]:
        """Each beam's decoder sequence so far (what HF's processors see)."""
        if self.table is None:
            return [[self.ctx.start_id]] * self.rows
        return self.table.ids[self.slot_rows, :self.cur_len].tolist()

    def next_tokens(self) -> list[int]:
        return [history[-1] for history in self.histories()]

    def add_finished(self, score: float, sequence: list[int]) -> None:
        """Insert keeping the nb best; an equal score goes after those already there (HF's top-k over [old
        finished, new] keeps the earlier one first)."""
        at = next((i for i, (s, _) in enumerate(self.finished) if score > s), len(self.finished))
        self.finished.insert(at, (score, sequence))
        del self.finished[self.rows:]

    def results(self) -> list[Candidate]:
        n = self.ctx.options.num_return_sequences
        found = [Candidate.of(sequence, score, self.ctx.eos_id) for score, sequence in self.finished[:n]]
        # HF's placeholders, if any: one object each, since results.candidates gives each its text
        return found + [Candidate([], EXCLUDED, False) for _ in range(n - len(found))]


def forced_candidates(nb: int, forced_ids: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The top 2 x nb of beam segments of nb beams at decoder length 1, where every beam's only finite token is the
    forced language token (log-prob 0): beam j's candidate scores its running score (only beam 0 expands at first),
    then nb </s> candidates of beam 0 at -inf. The same for every segment but for its forced token.
    Shape: forced_ids [B] int64; returns scores [B, 2nb] float32, parents and tokens [B, 2nb] int64."""
    b = forced_ids.size
    scores = np.array([0.0] + [EXCLUDED] * (nb - 1) + [float("-inf")] * nb, dtype=np.float32)
    parents = np.concatenate([np.arange(nb), np.zeros(nb, dtype=np.int64)])
    tokens = np.full((b, 2 * nb), eos_id, dtype=np.int64)
    tokens[:, :nb] = forced_ids[:, None]
    return np.tile(scores, (b, 1)), np.tile(parents, (b, 1)), tokens
