"""engine/beam_step.py: the device and host halves of a beam step take the same decisions (CPU tensors)."""
from __future__ import annotations

import numpy as np
import torch

from engine import beam_step
from kernels import reference
from kernels.reference_selection import EXCLUDED

EOS = 2


def random_candidates(rng: np.random.Generator, b: int, nb: int) -> tuple[np.ndarray, ...]:
    scores = -np.sort(rng.random((b, 2 * nb)).astype(np.float32) * 10, axis=1)  # best first
    parents = rng.integers(0, nb, (b, 2 * nb))
    tokens = rng.integers(3, 50, (b, 2 * nb))
    tokens[rng.random((b, 2 * nb)) < 0.3] = EOS
    return scores, parents, tokens


def test_device_and_host_halves_agree_on_tokens_reorder_and_scores():
    rng = np.random.default_rng(5)
    b, nb, rows_total, t = 7, 3, 32, 12
    scores, parents, tokens = random_candidates(rng, b, nb)
    cur_len = rng.integers(1, 9, b).tolist()
    max_length = [c + 1 if i % 3 == 0 else 20 for i, c in enumerate(cur_len)]  # every third one ends now
    rows = rng.permutation(rows_total)[:b * nb].reshape(b, nb)
    segments = [object() for _ in range(b)]
    step = beam_step.BeamStepInputs(segments, rows, np.array(cur_len), np.array(cur_len) + 1 >= np.array(max_length))
    history = torch.from_numpy(rng.integers(0, rows_total, (rows_total, t)).astype(np.int32))
    before = history.clone()
    row_scores = torch.zeros(rows_total)

    kept = beam_step.device_step(reference, step, *map(torch.from_numpy, (scores, parents, tokens)), EOS, history,
                                 row_scores)
    row_tokens = np.zeros(rows_total, dtype=np.int64)
    picks = beam_step.host_step(step, scores.astype(np.float64), parents, tokens, EOS, row_tokens)

    assert kept.tolist() == row_tokens[rows.reshape(-1)].tolist()
    assert picks.step is step
    for i in range(b):
        p, tok, s = picks.kept_parents[i].tolist(), picks.kept_tokens[i].tolist(), picks.kept_scores[i].tolist()
        stops = (tokens[i] == EOS) | (cur_len[i] + 1 >= max_length[i])
        order = np.argsort(stops, kind="stable")[:nb]  # the oracle: HF's keep, written out per segment
        assert tok == tokens[i, order].tolist() and p == parents[i, order].tolist()
        want = [float(np.float32(v) + np.float32(EXCLUDED)) if stp else float(v)
                for v, stp in zip(scores[i, order], stops[order])]
        assert s == want and row_scores[rows[i]].tolist() == [float(np.float32(v)) for v in want]
        assert picks.stops[i].tolist() == stops.tolist()
        for j in range(nb):  # beam j continues its parent's history up to the positions written
            src = rows[i, parents[i, order[j]]]
            assert history[rows[i, j], :cur_len[i]].tolist() == before[src, :cur_len[i]].tolist()
            assert history[rows[i, j], cur_len[i]:].tolist() == before[rows[i, j], cur_len[i]:].tolist()
