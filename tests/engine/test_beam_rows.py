"""engine/beam_search.py: a step applied to every beam segment at once (BeamRows.advance) leaves each segment where
HF's per-segment beam bookkeeping, written out here one segment at a time with Python floats, leaves it."""
from __future__ import annotations

import struct
from types import SimpleNamespace

import numpy as np
import pytest

from engine import beam_step
from engine.beam_search import BeamRows, BeamSearch
from engine.options import GenerationOptions
from engine.search import SearchContext
from kernels.reference_selection import EXCLUDED

START, FORCED, EOS = 2, 7, 2


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


class OracleBeam:
    """HF `_beam_search`'s bookkeeping for one segment: hypotheses as lists, finished set sorted by insertion."""

    def __init__(self, nb: int, opts: GenerationOptions):
        self.nb, self.opts = nb, opts
        self.running = [[START] for _ in range(nb)]
        self.finished: list[tuple[float, list[int]]] = []
        self.can_improve, self.done = True, False

    def advance(self, scores, parents, tokens, at_max: bool) -> None:
        nb, t = self.nb, len(self.running[0])
        stops = [tok == EOS or at_max for tok in tokens]
        norm = f32(t ** self.opts.length_penalty)
        full = len(self.finished) == nb
        if self.can_improve and not (full and self.opts.early_stopping):
            for j in range(nb):
                if stops[j]:
                    score = f32(scores[j] / norm)
                    at = next((i for i, (s, _) in enumerate(self.finished) if score > s), len(self.finished))
                    self.finished.insert(at, (score, self.running[parents[j]] + [tokens[j]]))
                    del self.finished[nb:]
        kept = [j for j in range(2 * nb) if not stops[j]] + [j for j in range(2 * nb) if stops[j]]
        kept = kept[:nb]
        best = scores[kept[0]] if not stops[kept[0]] else f32(f32(scores[kept[0]]) + f32(EXCLUDED))
        self.running = [self.running[parents[j]] + [tokens[j]] for j in kept]
        bar = EXCLUDED if len(self.finished) < nb else self.finished[-1][0]
        self.can_improve = self.can_improve and f32(best / norm) > bar
        self.done = (not self.can_improve or (len(self.finished) == nb and self.opts.early_stopping)
                     or all(stops))


def candidates(rng: np.random.Generator, nb: int, vocab: int) -> tuple[list[float], list[int], list[int]]:
    """2nb candidates best first, about one in five a </s>; float32 scores."""
    scores = sorted((float(np.float32(-rng.random() * 12)) for _ in range(2 * nb)), reverse=True)
    parents = rng.integers(0, nb, 2 * nb).tolist()
    tokens = [EOS if rng.random() < 0.2 else int(rng.integers(3, vocab)) for _ in range(2 * nb)]
    return scores, parents, tokens


@pytest.mark.parametrize("b, nb, seed", [(1, 2, 0), (5, 3, 1), (13, 4, 2), (31, 5, 3)])
def test_every_segment_advances_as_its_own_hf_bookkeeping(b, nb, seed):
    rng = np.random.default_rng(seed)
    rows_total, max_len = b * nb + 3, 40
    max_length = np.zeros(rows_total + 1, dtype=np.int64)
    table = BeamRows(max_len, max_length)
    searches, oracles, segments = [], [], []
    slot_rows = rng.permutation(rows_total)[:b * nb].reshape(b, nb)
    for i in range(b):
        opts = GenerationOptions(num_beams=nb, length_penalty=[1.0, 0.6, -0.5, 2.0][i % 4],
                                 early_stopping=bool(i % 3 == 1), num_return_sequences=1 + i % nb)
        ctx = SearchContext(opts, START, FORCED, EOS, int(rng.integers(4, max_len)), None)
        searches.append(BeamSearch(ctx))
        oracles.append(OracleBeam(nb, opts))
        segments.append(SimpleNamespace(search=searches[-1]))
        max_length[slot_rows[i]] = ctx.max_length
    table.start(searches, slot_rows.tolist())
    running = np.ones(b, dtype=bool)
    for step_no in range(max_len):
        live = np.flatnonzero(running)
        if not live.size:
            break
        step = table.step_inputs([segments[i] for i in live], slot_rows[live])
        drawn = [candidates(rng, nb, 60) for _ in live]
        scores, parents, tokens = (np.array([d[k] for d in drawn]) for k in range(3))
        picks = beam_step.host_step(step, scores.astype(np.float64), parents, tokens, EOS,
                                    np.zeros(rows_total + 1, dtype=np.int64))
        leaving = rng.random(live.size) < 0.05  # cancelled between launch and apply: must be left untouched
        for k, i in enumerate(live):
            if not leaving[k]:
                oracles[i].advance(drawn[k][0], drawn[k][1], drawn[k][2], bool(step.at_max[k]))
        done = set(live[table.advance(picks, ~leaving)].tolist())
        for k, i in enumerate(live):
            if leaving[k]:
                running[i] = False
                continue
            assert (i in done) == oracles[i].done, (step_no, i)
            if i in done:
                searches[i].end()
                running[i] = False
            else:
                assert searches[i].histories() == oracles[i].running
            assert searches[i].finished == oracles[i].finished
    for search, oracle in zip(searches, oracles):
        n = search.ctx.options.num_return_sequences
        results = search.results()
        assert len(results) == n
        assert [c.score for c in results[:len(oracle.finished)]] == [s for s, _ in oracle.finished[:n]]


@pytest.mark.parametrize("nb", [2, 3, 5])
def test_forced_first_step_candidates_are_the_top_of_hfs_forced_scores(nb):
    """At decoder length 1 every beam's only finite log-prob is the forced language token's: the candidates given
    for a whole width at once are, segment by segment, the top 2 x nb of HF's running scores plus those
    log-probs over nb x V (the finite ones exactly, the rest at -inf). Beams 1..nb-1 tie (the same history and
    score), so their order among themselves is torch.topk's to choose and changes nothing."""
    import torch
    from engine.beam_search import forced_candidates
    vocab, forced_ids = 11, np.array([7, 3, 10, 7])
    scores, parents, tokens = forced_candidates(nb, forced_ids, EOS)
    assert scores.shape == parents.shape == tokens.shape == (forced_ids.size, 2 * nb)
    for b, forced in enumerate(forced_ids.tolist()):
        logprobs = torch.full((nb, vocab), float("-inf"))
        logprobs[:, forced] = 0.0
        running = torch.tensor([0.0] + [EXCLUDED] * (nb - 1))[:, None]
        top, at = torch.topk((running + logprobs).flatten(), 2 * nb)
        finite = torch.isfinite(top).numpy()
        assert scores[b].tolist() == top.tolist()
        ours = sorted(zip(scores[b][finite].tolist(), parents[b][finite].tolist(), tokens[b][finite].tolist()))
        hfs = sorted(zip(top[finite].tolist(), (at[finite] // vocab).tolist(), (at[finite] % vocab).tolist()))
        assert ours == hfs
