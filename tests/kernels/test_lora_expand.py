"""The decoder step's LoRA on the GPU: one GEMM over a projection's weight stacked on every slot's A, then
lora_expand (or add_layer_norm with the LoRA arguments) adds each row's delta from its own h. Against the fp32
reference, bit for bit between the two ops that expand, and in a CUDA graph replayed with a new mix of adapters.
GPU only."""
from __future__ import annotations

import pytest
import torch

from engine.graphs import capture
from kernels import reference as ref
from tests.kernels.test_kernels import DEV, check, gen, lora_inputs, needs_ops, ops, randn

pytestmark = pytest.mark.gpu
RANKS = [0, 16, 4, 1, 0, 64, 7]  # base, full and odd ranks, an adapter that skips this site


def stacked_projection(n, parts, d_in, d_out, dtype, seed, ranks=RANKS):
    """x, the stacked weight's GEMM output y_ext [n, P*O + P*S*R], and the LoRA arguments. A is zero past each
    slot's rank and for slot 0, as the registry keeps it (the kernels read 16 ranks before the rank); Bt is not."""
    g = gen(seed)
    _, x, A, Bt, idx, rank_t = lora_inputs(n, len(ranks), parts, 64, d_in, d_out, dtype, g, ranks)
    for slot, rank in enumerate(ranks):
        A[slot, :, rank if slot else 0:] = 0
    w = randn(parts * d_out, d_in, dtype=dtype, g=g, scale=d_in ** -0.5)
    w_ext = torch.cat([w, A.transpose(0, 1).reshape(-1, d_in)])  # A of (part, slot, rank) after the weight
    return x, x @ w_ext.T, A, Bt, idx, rank_t


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 17, 300])
@pytest.mark.parametrize("parts_dims", [(3, 1024, 1024), (1, 1024, 4096), (1, 4096, 1024), (1, 64, 64), (2, 24, 40)])
@pytest.mark.parametrize("relu", [False, True])
def test_lora_expand_adds_each_rows_delta_from_its_own_h(dtype, n, parts_dims, relu):
    x, y_ext, A, Bt, idx, rank_t = stacked_projection(n, *parts_dims, dtype, 3 + n)
    before = y_ext.clone()
    want = ref.lora_expand(y_ext.float(), Bt.float(), idx, rank_t, relu)
    out = ops.lora_expand(y_ext, Bt, idx, rank_t, relu)
    assert out.data_ptr() == y_ext.data_ptr() and out.shape == want.shape  # in place, a view
    check(out, want, dtype, "lora_expand")
    width = out.shape[1]
    assert torch.equal(y_ext[:, width:], before[:, width:])  # h is read, not written
    untouched = (idx == 0) | (rank_t[idx] == 0)
    base = before[:, :width][untouched]
    assert torch.equal(out[untouched], torch.relu(base) if relu else base)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_layer_norm_with_the_lora_arguments_is_lora_expand_then_add_layer_norm_bit_for_bit(dtype):
    x, y_ext, A, Bt, idx, rank_t = stacked_projection(129, 1, 4096, 1024, dtype, 7)
    g = gen(8)
    residual, w, b = randn(129, 1024, dtype=dtype, g=g), randn(1024, dtype=dtype, g=g), randn(1024, dtype=dtype, g=g)
    h, normed = ops.add_layer_norm(residual, y_ext, w, b, 1e-5, Bt, idx, rank_t)
    expanded = ops.lora_expand(y_ext.clone(), Bt, idx, rank_t).contiguous()
    h_want, normed_want = ops.add_layer_norm(residual, expanded, w, b, 1e-5)
    assert torch.equal(h, h_want) and torch.equal(normed, normed_want)
    _, normed_ref = ref.add_layer_norm(residual.float(), y_ext.float(), w.float(), b.float(), 1e-5, Bt.float(), idx,
                                       rank_t)
    check(normed, normed_ref, dtype, "add_layer_norm with a LoRA delta")


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 17, 300])
@pytest.mark.parametrize("d, with_delta", [(1024, True), (1024, False), (4096, False), (64, True)])
def test_add_layer_norm_shrink_appends_each_rows_h_for_the_next_projection(dtype, n, d, with_delta):
    """The next projection's h after the normed row: the row's slot's A . normed up to its rank, every other
    column exactly 0; the normed row itself bit for bit as without the shrink."""
    x, y_ext, A_prev, Bt, idx, rank_t = stacked_projection(n, 1, d, d, dtype, 11 + n)
    _, _, A, _, _, _ = stacked_projection(n, 1, d, d, dtype, 12 + n)  # the next site's stacks (zero past ranks)
    g = gen(13 + n)
    residual, w, b = randn(n, d, dtype=dtype, g=g), randn(d, dtype=dtype, g=g), randn(d, dtype=dtype, g=g)
    delta = (Bt, idx, rank_t) if with_delta else ()
    x_in = y_ext if with_delta else y_ext[:, :d]
    h, normed = ops.add_layer_norm(residual, x_in, w, b, 1e-5, *delta, shrink=(A, idx, rank_t))
    h_plain, normed_plain = ops.add_layer_norm(residual, x_in, w, b, 1e-5, *delta)
    slots, _, rank_max, _ = A.shape
    assert normed.shape == (n, d + slots * rank_max)
    assert torch.equal(h, h_plain) and torch.equal(normed[:, :d], normed_plain)
    _, want = ref.add_layer_norm(residual.float(), x_in.float(), w.float(), b.float(), 1e-5,
                                 *[t.float() if t.is_floating_point() else t for t in delta],
                                 shrink=(A.float(), idx, rank_t))
    own = torch.zeros(n, slots, rank_max, dtype=torch.bool, device=DEV)
    for row, slot in enumerate(idx.tolist()):
        own[row, slot, :rank_t[slot]] = slot > 0
    ext = normed[:, d:].view(n, slots, rank_max)
    assert not ext[~own].any()  # other slots, ranks past the slot's and base rows: exactly 0
    check(ext.float(), want[:, d:].view(n, slots, rank_max), dtype, "add_layer_norm shrink")


@needs_ops
def test_lora_expand_checks_the_stacked_width():
    x, y_ext, A, Bt, idx, rank_t = stacked_projection(4, 1, 64, 64, torch.bfloat16, 9)
    with pytest.raises(ValueError, match="expected"):
        ops.lora_expand(y_ext[:, :-16], Bt, idx, rank_t)
    with pytest.raises(ValueError, match="ranks"):
        ops.lora_expand(y_ext, Bt, idx, rank_t.long())


@needs_ops
def test_lora_expand_in_a_graph_reads_slots_and_weights_at_replay():
    """Captured once, the launch serves any later mix: slots, ranks and Bt are read at replay."""
    ranks = [0, 16, 8, 0, 16]
    x, y_ext, A, Bt, idx, rank_t = stacked_projection(33, 3, 1024, 1024, torch.bfloat16, 11, ranks)
    base = y_ext.clone()
    graph, _ = capture(lambda: ops.lora_expand(y_ext, Bt, idx, rank_t), None)
    g = gen(12)
    idx.copy_(torch.randint(0, len(ranks), (33,), device=DEV, generator=g))  # a new mix of adapters
    Bt[3, :, :4] = randn(3, 4, 1024, dtype=Bt.dtype, g=g, scale=0.05)  # an adapter installed after the capture
    rank_t[3] = 4
    y_ext.copy_(base)
    graph.replay()
    torch.cuda.synchronize()
    check(y_ext[:, :3072], ref.lora_expand(base.float(), Bt.float(), idx, rank_t), torch.bfloat16, "replay")


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_append_lora_is_lora_expand_then_kv_append_bit_for_bit(dtype):
    n, H, T, D = 40, 16, 12, 64
    x, y_ext, A, Bt, idx, rank_t = stacked_projection(n, 3, 1024, H * D, dtype, 13)
    g = gen(14)
    k_cache, v_cache = randn(n, H, T, D, dtype=dtype, g=g), randn(n, H, T, D, dtype=dtype, g=g)
    rows, positions = torch.randperm(n, device=DEV, generator=g), torch.randint(0, T, (n,), device=DEV, generator=g)
    original, want_ext, want_k, want_v = y_ext.clone(), y_ext.clone(), k_cache.clone(), v_cache.clone()
    qkv = ops.kv_append_lora(k_cache, v_cache, rows, positions, y_ext, Bt, idx, rank_t)
    expanded = ops.lora_expand(want_ext, Bt, idx, rank_t)
    _, k, v = (t.reshape(n, H, D) for t in expanded.split(H * D, dim=-1))
    ops.kv_append(want_k, want_v, rows, positions, k, v)
    assert torch.equal(qkv, expanded) and torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    q_ref = ref.kv_append_lora(want_k.float(), want_v.float(), rows, positions, original.float(), Bt.float(), idx,
                               rank_t)
    check(qkv, q_ref, dtype, "kv_append_lora q|k|v")



@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hd", [(16, 64), (4, 16), (8, 32), (2, 128)])  # D 128: q expanded in a copy first
@pytest.mark.parametrize("plan", [(1, 1, 1 << 30), (4, 1, 1 << 30), (4, 2, 16)])  # warps an item, splits, chunk
def test_cross_attention_adds_the_query_delta_as_it_loads_q(dtype, hd, plan, monkeypatch):
    H, D = hd
    n = 37
    monkeypatch.setattr(ops, "attention_plan", lambda nh, bound, d: plan)
    x, q_ext, A, Bt, idx, rank_t = stacked_projection(n, 1, 256, H * D, dtype, 15)
    g = gen(16)
    pool = randn(60, H, D, dtype=dtype, g=g)
    starts = torch.randint(0, 30, (n,), device=DEV, generator=g)
    lengths = torch.randint(1, 31, (n,), device=DEV, generator=g)
    before = q_ext.clone()
    out = ops.cross_attention(q_ext, pool, pool, starts, lengths, D ** -0.5, max_len=30, q_lora=(Bt, idx, rank_t))
    assert torch.equal(q_ext, before)  # read, not written
    want = ref.cross_attention(q_ext.float(), pool.float(), pool.float(), starts, lengths, D ** -0.5,
                               q_lora=(Bt.float(), idx, rank_t))
    check(out, want, dtype, f"cross_attention with q_lora, plan {plan}")
    base = ref.cross_attention(q_ext.float()[:, :H * D].view(n, H, D), pool.float(), pool.float(), starts, lengths,
                               D ** -0.5)
    adapted = (idx > 0) & (rank_t[idx] > 0)
    assert not torch.allclose(want[adapted], base[adapted], atol=1e-2)  # the delta is big enough to be seen
