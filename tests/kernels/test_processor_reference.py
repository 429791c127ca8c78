"""The references of the processor ops (kernels/reference_selection.py apply_processors, sampling_warp), which
are the CPU path, against transformers' own processor and warper classes, row by row: rows of one call mix
options (penalties, n-gram sizes, </s> bans, temperatures, top-k, top-p) as a step's segments do; and the draw
(sample_draw) against torch.multinomial. CPU."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor,
                                                    NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from kernels import reference_selection as ref

EOS, V = 2, 300


def histories(g: torch.Generator, n: int, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded int64 histories over a small token range (repeats and n-gram hits are common), and lengths."""
    lengths = torch.randint(1, longest + 1, (n,), generator=g)
    ids = torch.randint(0, 12, (n, longest), generator=g)
    return ids, lengths


@pytest.mark.parametrize("seed", range(6))
def test_apply_processors_matches_transformers_row_by_row(seed):
    g = torch.Generator().manual_seed(seed)
    n, total = 7, 11
    scores = torch.randn(total, V, generator=g) * 3
    rows = torch.randperm(total, generator=g)[:n]
    ids, lengths = histories(g, n, 9)
    penalty = torch.tensor([1.0, 1.3, 0.7, 2.0, 1.0, 1.1, 1.0], dtype=torch.float32)
    ngram = torch.tensor([0, 1, 2, 3, 2, 0, 5])
    ban = torch.tensor([0, 1, 0, 1, 1, 0, 0])
    got = scores.clone()
    ref.apply_processors(got, rows, ids, lengths, penalty, ngram, ban, EOS)
    want = scores.clone()
    for i in range(n):
        h, row = ids[i, :lengths[i]][None], scores[rows[i]][None]
        if penalty[i] != 1:
            row = RepetitionPenaltyLogitsProcessor(float(penalty[i]))(h, row)
        if ngram[i]:
            row = NoRepeatNGramLogitsProcessor(int(ngram[i]))(h, row)
        if ban[i]:  # min_new_tokens one more than the new tokens so far
            row = MinNewTokensLengthLogitsProcessor(0, h.shape[1] + 1, EOS)(h, row)
        want[rows[i]] = row[0]
    assert torch.equal(got, want)
    assert not torch.equal(got, scores), "nothing changed: a weak case"


@pytest.mark.parametrize("seed", range(6))
def test_sampling_warp_matches_transformers_row_by_row(seed):
    g = torch.Generator().manual_seed(seed)
    params = [(1.0, 0, 0.9), (0.5, 5, 1.0), (1.5, 50, 0.5), (1.0, 1, 1.0), (0.7, 0, 1.0), (1.2, 400, 0.95),
              (1.0, 20, 0.3)]
    scores = torch.randn(len(params), V, generator=g) * 2
    scores[:, ::37] = float("-inf")  # tokens the processors banned
    got = ref.sampling_warp(scores, torch.tensor([p[0] for p in params]), torch.tensor([p[1] for p in params]),
                            torch.tensor([p[2] for p in params], dtype=torch.float64))
    for i, (temperature, top_k, top_p) in enumerate(params):
        want = TemperatureLogitsWarper(temperature)(None, scores[i][None])
        if top_k:
            want = TopKLogitsWarper(top_k)(None, want)
        if top_p < 1.0:
            want = TopPLogitsWarper(top_p)(None, want)
        assert torch.equal(got[i], want[0]), params[i]


def test_sample_draw_draws_what_torch_multinomial_draws_with_each_rows_generator():
    g = torch.Generator().manual_seed(11)
    probs = torch.rand(6, 500, generator=g)
    probs[::2] = probs[::2].masked_fill(probs[::2] < 0.9, 0.0)  # some rows cut to a few tokens
    probs /= probs.sum(1, keepdim=True)
    mine = [torch.Generator().manual_seed(100 + i) for i in range(6)]
    theirs = [torch.Generator().manual_seed(100 + i) for i in range(6)]
    for _ in range(3):  # each draw moves the generators on as multinomial does
        got = ref.sample_draw(probs, mine)
        assert got.tolist() == [int(torch.multinomial(probs[i], 1, generator=theirs[i])) for i in range(6)]
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(mine, theirs))
