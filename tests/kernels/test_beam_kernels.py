"""The beam search kernels (kernels/cuda/beam.cu) against their references (kernels/reference_selection.py), on
random segments of odd counts and beam widths: stopped candidates, segments at max_length, parents that are
other beams of the segment, and histories of different lengths. GPU only."""
from __future__ import annotations

import pytest
import torch

from kernels import reference_selection as ref
from tests.kernels.gpu import DEV, gen, needs_ops, ops

pytestmark = pytest.mark.gpu
EOS = 2


def beam_inputs(b: int, nb: int, k: int, rows_total: int, g: torch.Generator):
    """Per-beam top-k log-probs (distinct values, best first), their tokens (some </s>), running scores, and
    the segments' slot rows (a random permutation of the table)."""
    values = -torch.rand(b * nb, k, device=DEV, generator=g).mul(10).sort(dim=1).values
    tokens = torch.randint(3, 300, (b * nb, k), device=DEV, generator=g)
    tokens[torch.rand(b * nb, k, device=DEV, generator=g) < 0.2] = EOS
    row_scores = -torch.rand(rows_total, device=DEV, generator=g) * 20
    rows = torch.randperm(rows_total, device=DEV, generator=g)[:b * nb].view(b, nb)
    return values, tokens, row_scores, rows


@needs_ops
@pytest.mark.parametrize("b, nb", [(1, 2), (1, 4), (3, 5), (17, 4), (64, 4), (2, 64)])
def test_beam_candidates_match_the_reference(b, nb):
    g = gen(91 + b * nb)
    values, tokens, row_scores, rows = beam_inputs(b, nb, 2 * nb + (b % 2), b * nb + 5, g)
    got, want = ops.beam_candidates(values, tokens, row_scores, rows), ref.beam_candidates(values, tokens,
                                                                                           row_scores, rows)
    for name, x, y in zip(("scores", "parents", "tokens"), got, want):
        assert torch.equal(x, y), name


@needs_ops
def test_beam_candidates_put_the_lower_candidate_first_on_ties_and_nan_first():
    values = torch.tensor([[-1.0, -2.0], [-1.0, float("nan")]], device=DEV)  # one segment of 2 beams, k = 2
    tokens = torch.tensor([[10, 11], [12, 13]], device=DEV)
    scores, parents, picked = ops.beam_candidates(values, tokens, torch.zeros(2, device=DEV),
                                                  torch.tensor([[0, 1]], device=DEV))
    assert torch.isnan(scores[0, 0]) and scores[0, 1:].tolist() == [-1.0, -1.0, -2.0]
    assert picked.tolist() == [[13, 10, 12, 11]] and parents.tolist() == [[1, 0, 1, 0]]


@needs_ops
@pytest.mark.parametrize("b, nb, t", [(1, 2, 7), (1, 4, 256), (3, 5, 40), (17, 4, 300), (2, 64, 130)])
def test_beam_step_matches_the_reference(b, nb, t):
    g = gen(97 + b * nb + t)
    rows_total = b * nb + 3
    values, tokens, row_scores, rows = beam_inputs(b, nb, 2 * nb, rows_total, g)
    scores, parents, picked = ref.beam_candidates(values, tokens, row_scores, rows)
    lengths = torch.randint(1, t + 1, (b,), device=DEV, generator=g)
    lengths[0] = t
    at_max = (torch.rand(b, device=DEV, generator=g) < 0.3).long()
    history = torch.randint(0, rows_total, (rows_total, t), device=DEV, generator=g, dtype=torch.int32)
    state = {"ops": (history.clone(), row_scores.clone()), "ref": (history.clone(), row_scores.clone())}
    kept = {name: impl.beam_step(scores, parents, picked, rows, lengths, at_max, EOS, *state[name])
            for name, impl in (("ops", ops), ("ref", ref))}
    assert torch.equal(kept["ops"], kept["ref"])
    assert torch.equal(state["ops"][0], state["ref"][0]), "history"
    assert torch.equal(state["ops"][1], state["ref"][1]), "row scores"
    assert not torch.equal(state["ops"][0], history), "the reorder moved nothing: a weak case"


@needs_ops
def test_beam_ops_refuse_widths_and_layouts_they_do_not_take():
    values, tokens, row_scores, rows = beam_inputs(1, 4, 8, 8, gen(5))
    with pytest.raises(ValueError, match="values"):
        ops.beam_candidates(values.double(), tokens, row_scores, rows)
    with pytest.raises(ValueError, match="beams"):
        ops.beam_candidates(values, tokens, row_scores, torch.arange(65, device=DEV).view(1, 65))
    with pytest.raises(ValueError, match="history"):
        ops.beam_step(*ops.beam_candidates(values, tokens, row_scores, rows), rows, torch.ones(1, device=DEV).long(),
                      torch.zeros(1, device=DEV).long(), EOS, torch.zeros(8, 4, device=DEV).long(), row_scores)


@needs_ops
@pytest.mark.parametrize("n, k", [(1, 8), (5, 9), (64, 16)])
def test_topk_logprobs_ban_keeps_the_token_out_of_the_picks_but_in_the_log_softmax(n, k):
    """Oracle: HF's order written out, log_softmax over every token, then </s> at -inf in banned rows, then top k
    (bf16 logits tie often: the picks are compared through their values, which ties share)."""
    g = gen(101 + n)
    logits = torch.randn(n, 256206, device=DEV, generator=g).to(torch.bfloat16)
    logits[:, EOS] = 30.0  # </s> would win every row
    ban = (torch.arange(n, device=DEV) % 2 == 0).long()
    logprobs = torch.log_softmax(logits.float(), -1)
    banned = logprobs.masked_fill(ban.bool()[:, None] & (torch.arange(logprobs.shape[1], device=DEV) == EOS),
                                  float("-inf"))
    want_values, _ = torch.topk(banned, k)
    values, tokens = ops.topk_logprobs(logits, k, ban, EOS)
    torch.testing.assert_close(values, want_values, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(banned.gather(1, tokens), values, atol=1e-4, rtol=1e-5)  # each pick scores its value
    assert (tokens[1::2, 0] == EOS).all() and not (tokens[::2] == EOS).any()
    assert all(len(set(row)) == k for row in tokens.tolist())
    torch.testing.assert_close(ref.topk_logprobs(logits, k, ban, EOS)[0], values, atol=1e-4, rtol=1e-5)
