"""decode_attention and cross_attention with their output projection (out_proj): a sentence's rows in one launch
(kernels/cuda/attention_out.cu) as each head's share of the projection, which add_layer_norm adds up; more rows as
the attention then `linear`; both against the fp32 reference. GPU only (`pytest -m gpu tests/kernels`)."""
from __future__ import annotations

import pytest
import torch

from engine.graphs import capture
from kernels import reference as ref
from kernels.partial_sums import PartialSums
from tests.kernels.gpu import DEV, DTYPES, check, gen, needs_ops, ops, poison_allocator, randn, split_heads_strided
from tests.kernels.test_ops import cross_inputs, decode_inputs

pytestmark = pytest.mark.gpu

HEADS = [(16, 64), (2, 64), (8, 128)]  # 600M's heads; the fewest that fill a chunk of outputs; heads of 128


@pytest.fixture
def fused_launches(monkeypatch):
    """How many launches took the one-launch kernel (a list, one entry a launch)."""
    from kernels import ops_attention_out
    seen = []
    launch = ops_attention_out.launch_attention_out
    monkeypatch.setattr(ops_attention_out, "launch_attention_out", lambda *a: seen.append(1) or launch(*a))
    return seen


def projection(d: int, dtype: torch.dtype, g: torch.Generator, with_bias: bool):
    return randn(d, d, dtype=dtype, g=g, scale=d ** -0.5), randn(d, dtype=dtype, g=g) if with_bias else None


def total(out: torch.Tensor | PartialSums, dtype: torch.dtype) -> torch.Tensor:
    """The projection an op gave: a tensor, or the heads' shares added in head order with the bias, rounded once."""
    return out.total(dtype) if isinstance(out, PartialSums) else out


def projected_reference(attn: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The fp32 reference's attention [N, H, D], rounded to the kernel's storage dtype as a stored output is, then
    projected in fp32."""
    rounded = attn.to(weight.dtype).float()
    return ref.linear(rounded.reshape(attn.shape[0], -1), weight.float(), None if bias is None else bias.float())


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("with_history", [False, True])
@pytest.mark.parametrize("append", [False, True])
def test_decode_attention_with_its_projection_equals_the_reference(dtype, n, heads, with_history, append,
                                                                   fused_launches):
    """Up to 4 rows in one launch, 5 as the attention then `linear`: the projected attention over ragged lengths
    (one key, the whole cache), through a history table, with the step's keys appended (the caches then equal
    kv_append's, bit for bit) and with and without a bias, against the fp32 reference."""
    H, D = heads
    T = 256  # the engine's capacity (heads of 128 split it where the projection is apart)
    g = gen(n * 7 + D + H + 2 * with_history + append)
    q, k_cache, v_cache, _, lengths = decode_inputs(n, H, T, D, dtype, g)
    R = k_cache.shape[0]
    rows = torch.randperm(R, device=DEV, generator=g)[:n]
    history = None
    if with_history:  # as the engine's: no position written in this step is read through another row's table
        history = torch.randint(0, R, (R, T), device=DEV, generator=g, dtype=torch.int32)
        written_at = torch.full((R,), -1, device=DEV)
        written_at[rows] = lengths - 1
        positions = torch.arange(T, device=DEV)[None, :]
        history = torch.where(written_at[history.long()] == positions, torch.arange(R, device=DEV)[:, None],
                              history).to(torch.int32)
        history[rows, lengths - 1] = rows.to(torch.int32)
    new_kv = tuple(split_heads_strided(n, H, D, dtype, g)[1:]) if append else None
    weight, bias = projection(H * D, dtype, g, with_bias=n % 2 == 1)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    if append:
        ref.kv_append(k_want, v_want, rows, lengths - 1, *new_kv)
    attn = ref.decode_attention(q.float(), k_want.float(), v_want.float(), rows, lengths, D ** -0.5, history=history)
    poison_allocator()
    out = ops.decode_attention(q, k_cache, v_cache, rows, lengths, D ** -0.5, history=history, new_kv=new_kv,
                               out_proj=(weight, bias))
    assert len(fused_launches) == (n <= 4) and isinstance(out, PartialSums) == (n <= 4)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
    check(total(out, dtype), projected_reference(attn, weight, bias), dtype, f"projected attention, {n} rows")


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("segments_beams", [(1, 1), (1, 4), (3, 1), (2, 2), (5, 1)])
@pytest.mark.parametrize("heads", HEADS)
def test_cross_attention_with_its_projection_equals_the_reference(dtype, segments_beams, heads, fused_launches):
    H, D = heads
    segs, beams = segments_beams
    g = gen(segs * 5 + beams + D + H)
    q, k_pool, v_pool, starts, lens, max_len = cross_inputs(segs, beams, H, D, dtype, g, max_src=40)
    weight, bias = projection(H * D, dtype, g, with_bias=True)
    attn = ref.cross_attention(q.float(), k_pool.float(), v_pool.float(), starts, lens, D ** -0.5)
    poison_allocator()
    out = ops.cross_attention(q, k_pool, v_pool, starts, lens, D ** -0.5, max_len=64, out_proj=(weight, bias))
    assert len(fused_launches) == (segs * beams <= 4)
    check(total(out, dtype), projected_reference(attn, weight, bias), dtype,
          f"projected cross-attention {segments_beams}")


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("parts_d", [(16, 1024), (32, 2048), (2, 128), (7, 64)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_add_layer_norm_adds_the_shares_in_order_and_rounds_once(dtype, n, parts_d, with_bias):
    """add_layer_norm of PartialSums (any number of parts, four loads in flight and the rest one by one) equals the
    reference's LayerNorm of their total: h as the reference's, normed within the usual bound."""
    P, d = parts_d
    g = gen(P * 3 + d + n + with_bias)
    residual = randn(n, d, dtype=dtype, g=g, scale=3.0)
    x = PartialSums(randn(P, n, d, g=g, scale=P ** -0.5), randn(d, dtype=dtype, g=g) if with_bias else None)
    w, b = randn(d, dtype=dtype, g=g), randn(d, dtype=dtype, g=g)
    poison_allocator()
    h, normed = ops.add_layer_norm(residual, x, w, b, 1e-5)
    h_ref, normed_ref = ref.add_layer_norm(residual, x, w, b, 1e-5)
    check(h, h_ref, dtype, "h of the shares", tol=1e-6)  # the same fp32 additions in the same order
    check(normed, normed_ref, dtype, "normed of the shares")


@needs_ops
def test_projected_attention_replays_in_a_graph_with_the_eager_bits():
    """Replays of a captured step on new queries give, bit for bit, what eager launches give: the shares, and
    the LayerNorm that adds them up."""
    H, D, T, n = 16, 64, 256, 2
    g = gen(91)
    q, k_cache, v_cache, rows, lengths = decode_inputs(n, H, T, D, torch.bfloat16, g)
    weight, bias = projection(H * D, torch.bfloat16, g, with_bias=True)
    residual, w, b = (randn(*shape, dtype=torch.bfloat16, g=g) for shape in ((n, H * D), (H * D,), (H * D,)))

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        out = ops.decode_attention(q, k_cache, v_cache, rows, lengths, D ** -0.5, out_proj=(weight, bias))
        return out.parts, ops.add_layer_norm(residual, out, w, b, 1e-5)[1]

    graph, (parts, normed) = capture(step, None)
    for replay in range(4):
        q.copy_(randn(*q.shape, dtype=q.dtype, g=g))
        graph.replay()
        eager_parts, eager_normed = step()
        assert torch.equal(parts, eager_parts) and torch.equal(normed, eager_normed), f"replay {replay}"
