"""The processor and sampling kernels (kernels/cuda/processors.cu, sampling.cu) against their references
(kernels/reference_selection.py): rows of one call mixing options, histories with repeats and n-gram hits, ties at
the top-k cut, -0 and +0, banned (-inf) tokens, NaN rows, and top-p cuts against a float64 oracle (the reference's
float32 cumsum is itself only exact to its rounding). GPU only."""
from __future__ import annotations

import pytest
import torch

from kernels import reference_selection as ref
from tests.kernels.gpu import DEV, gen, needs_ops, ops

pytestmark = pytest.mark.gpu
EOS = 2


@pytest.fixture(params=[None, False], ids=["auto", "one-block"])
def warp_kernel(request, monkeypatch):
    """sampling_warp's two kernels: the cluster version where the GPU has clusters, and the one-block version."""
    from kernels import ops_selection
    monkeypatch.setattr(ops_selection, "SAMPLE_CLUSTERS", request.param)


@needs_ops
@pytest.mark.parametrize("n, total, V, longest", [(1, 1, 1000, 1), (3, 5, 1000, 9), (17, 40, 256206, 64),
                                                  (64, 64, 256206, 300)])
def test_apply_processors_matches_the_reference(n, total, V, longest):
    g = gen(7 + n + longest)
    scores = torch.randn(total, V, device=DEV, generator=g) * 3
    rows = torch.randperm(total, device=DEV, generator=g)[:n]
    lengths = torch.randint(1, longest + 1, (n,), device=DEV, generator=g)
    ids = torch.randint(0, 16, (n, longest), device=DEV, generator=g)  # small range: repeats, n-gram hits
    ids[:, ::5] = torch.randint(0, V, (n, len(range(0, longest, 5))), device=DEV, generator=g)
    penalty = torch.tensor([1.0, 1.3, 0.7, 2.5], device=DEV).repeat(n)[:n].contiguous()
    ngram = torch.tensor([0, 1, 2, 3, 4], device=DEV).repeat(n)[:n].contiguous()
    ban = torch.randint(0, 2, (n,), device=DEV, generator=g)
    got, want = scores.clone(), scores.clone()
    ops.apply_processors(got, rows, ids, lengths, penalty, ngram, ban, EOS)
    ref.apply_processors(want, rows, ids, lengths, penalty, ngram, ban, EOS)
    assert torch.equal(got, want)
    assert n == 1 or not torch.equal(got, scores), "nothing changed: a weak case"


def top_p_oracle(x: torch.Tensor, top_p: float, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(must keep, must drop) masks of one row's top-p cut from float64 masses, leaving out the elements whose
    mass at and below lies within eps of 1 - top_p."""
    p = torch.softmax(x.double(), -1)
    order = torch.argsort(x, stable=True)
    cum = torch.empty_like(p)
    cum[order] = p[order].cumsum(0)
    # ties share the mass at and below the last of them
    sorted_x = x[order]
    last_of_tie = torch.searchsorted(sorted_x, sorted_x, right=True) - 1
    cum[order] = cum[order][last_of_tie]
    q = 1.0 - top_p
    keep, drop = cum > q + eps, cum <= q - eps
    keep[x == x.max()] = True
    return keep, drop & (x != x.max())


@needs_ops
@pytest.mark.parametrize("V", [1000, 256206])
@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])
def test_sampling_warp_matches_the_reference_and_a_float64_top_p(V, scale, warp_kernel):
    params = [(1.0, 0, 0.9), (0.5, 5, 1.0), (1.5, 50, 0.5), (1.0, 1, 1.0), (0.7, 0, 1.0), (1.2, 400, 0.95),
              (1.0, 20, 0.3), (1.0, 0, 0.999), (2.0, 0, 1e-6), (1.0, V - 1, 1.0), (1.0, V, 0.8)]
    g = gen(int(V + scale * 10))
    scores = torch.randn(len(params), V, device=DEV, generator=g) * scale
    scores[:, ::37] = float("-inf")
    temperature = torch.tensor([p[0] for p in params], device=DEV)
    top_k = torch.tensor([p[1] for p in params], device=DEV)
    top_p = torch.tensor([p[2] for p in params], device=DEV, dtype=torch.float64)
    got = ops.sampling_warp(scores, temperature, top_k, top_p)
    want = ref.sampling_warp(scores, temperature, top_k, top_p)
    assert torch.equal(ops.sampling_warp(scores, temperature, top_k, top_p), got), "not deterministic"
    for i, (t, k, p) in enumerate(params):
        if p == 1.0:
            assert torch.equal(got[i], want[i]), params[i]
            continue
        x = scores[i] / t
        if 0 < k < V:
            x = ref.sampling_warp(scores[i:i + 1], temperature[i:i + 1], top_k[i:i + 1],
                                  torch.ones(1, device=DEV, dtype=torch.float64))[0]
        keep, drop = top_p_oracle(x, p)
        kept = got[i] != float("-inf")
        assert kept[keep].all() and not kept[drop].any(), params[i]
        assert torch.equal(got[i][kept], x[kept]), params[i]
        assert (kept != (want[i] != float("-inf"))).sum() <= 32, params[i]  # the reference's rounding band


@needs_ops
@pytest.mark.parametrize("k, p", [(100_000, 1.0), (7, 1.0), (0, 0.5), (150_000, 0.3)])
def test_sampling_warp_narrows_a_bin_too_full_to_sort_by_key_bytes(k, p, warp_kernel):
    """A near-flat row: every element within 1/32 nat of the max (two bins of ~128k), so the cut's bin is
    narrowed by the radix passes before its elements fit in shared memory."""
    V = 256206
    g = gen(k + int(p * 10))
    scores = torch.rand(1, V, device=DEV, generator=g) / 32
    args = (torch.ones(1, device=DEV), torch.tensor([k], device=DEV), torch.tensor([p], device=DEV,
                                                                                   dtype=torch.float64))
    got, want = ops.sampling_warp(scores, *args), ref.sampling_warp(scores, *args)
    if p == 1.0:
        assert torch.equal(got, want)
        return
    x = ref.sampling_warp(scores, args[0], args[1], torch.ones(1, device=DEV, dtype=torch.float64))[0]
    keep, drop = top_p_oracle(x, p, eps=1e-7)
    kept = got[0] != float("-inf")
    assert kept[keep].all() and not kept[drop].any()


@needs_ops
def test_sampling_warp_keeps_every_tie_at_the_kth_value_and_counts_minus_zero_as_zero(warp_kernel):
    V = 5000
    scores = torch.full((3, V), -5.0, device=DEV)
    scores[0, 100:110] = 2.0  # ten ties at the top: top-3 keeps all ten
    scores[1, :4] = torch.tensor([1.0, 0.0, -0.0, 0.0], device=DEV)  # top-3: 1, 0 and every zero
    scores[2, 7] = float("nan")
    args = (torch.ones(3, device=DEV), torch.tensor([3, 3, 3], device=DEV), torch.ones(3, device=DEV,
                                                                                          dtype=torch.float64))
    got, want = ops.sampling_warp(scores, *args), ref.sampling_warp(scores, *args)
    assert torch.equal(got[:2], want[:2])
    assert (got[0] != float("-inf")).sum() == 10 and (got[1] != float("-inf")).sum() == 4
    assert torch.isnan(got[2, 7]) and torch.equal(got[2].nan_to_num(), scores[2].nan_to_num()), "NaN row: scaled"


@needs_ops
def test_sampling_warp_leaves_an_all_banned_row_alone(warp_kernel):
    scores = torch.full((1, 1000), float("-inf"), device=DEV)
    got = ops.sampling_warp(scores, torch.ones(1, device=DEV), torch.tensor([5], device=DEV),
                            torch.tensor([0.5], device=DEV, dtype=torch.float64))
    assert torch.equal(got, scores)


@needs_ops
def test_processor_ops_refuse_what_they_do_not_take():
    scores = torch.zeros(2, 10, device=DEV)
    one = torch.ones(1, device=DEV, dtype=torch.int64)
    with pytest.raises(ValueError, match="scores"):
        ops.sampling_warp(scores.half(), torch.ones(2, device=DEV), one.repeat(2), torch.ones(2, device=DEV).double())
    with pytest.raises(ValueError, match="top_p"):
        ops.sampling_warp(scores, torch.ones(2, device=DEV), one.repeat(2), torch.ones(2, device=DEV))
    with pytest.raises(ValueError, match="ids"):
        ops.apply_processors(scores, one, one, one, torch.ones(1, device=DEV), one, one, EOS)


def _generators(n: int, first_seed: int, draws_before: list[int]) -> list[torch.Generator]:
    """n CUDA generators, seeds above 2^63 among them, each already moved on by some draws."""
    out = []
    for i in range(n):
        g = gen((first_seed + i * 0x9E3779B97F4A7C15) % 2**64)
        for _ in range(draws_before[i % len(draws_before)]):
            torch.empty(5, device=DEV).exponential_(1, generator=g)
        out.append(g)
    return out


@needs_ops
@pytest.mark.parametrize("n, V", [(1, 1000), (3, 256206), (17, 256206), (256, 256206), (2, 600_000)])
def test_sample_draw_draws_torch_multinomials_tokens_and_moves_each_generator_as_it_does(n, V):
    """The kernel makes torch's Philox noise itself: its picks are those of exponential_ a row (the reference, and
    torch.multinomial), on dense rows where the pick depends on every element's noise, on top-k-cut rows of zeros,
    on a NaN row; V = 600,000 takes torch's draw past one element a thread."""
    g = gen(n + V)
    probs = torch.rand(n, V, device=DEV, generator=g)
    cut = probs < probs.topk(min(50, V), dim=1).values[:, -1:]
    probs[1::2] = probs[1::2].masked_fill(cut[1::2], 0.0)  # odd rows: top-k, the rest 0
    probs /= probs.sum(1, keepdim=True)
    if n > 2:
        probs[2, 7] = float("nan")
    draws_before = [0, 1, 3]
    mine, theirs, hf = (_generators(n, 2**63 + 5, draws_before) for _ in range(3))
    got = ops.sample_draw(probs, mine)
    want = ref.sample_draw(probs, theirs)
    assert torch.equal(got, want)
    assert [g.get_offset() for g in mine] == [g.get_offset() for g in theirs]
    finite = [i for i in range(n) if i != 2]  # multinomial asserts on a NaN row
    one_by_one = [int(torch.multinomial(probs[i], 1, generator=hf[i])) for i in finite]
    assert got[finite].tolist() == one_by_one
    if n > 2:
        assert int(got[2]) == 7  # NaN is the largest, as torch.argmax has it
    again = ops.sample_draw(probs, mine)  # the next draw follows on from the moved generators
    assert torch.equal(again, ref.sample_draw(probs, theirs))


@needs_ops
def test_sample_draw_refuses_generators_that_are_not_one_cuda_generator_a_row():
    probs = torch.full((2, 8), 0.125, device=DEV)
    with pytest.raises(ValueError, match="one CUDA generator a row"):
        ops.sample_draw(probs, [gen(1)])
    with pytest.raises(ValueError, match="one CUDA generator a row"):
        ops.sample_draw(probs, [gen(1), torch.Generator().manual_seed(2)])
