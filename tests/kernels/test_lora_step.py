"""The decoder step's LoRA on the GPU (engine/lora.py): after one GEMM over a projection's weight stacked on every
slot's A, add_layer_norm and kv_append_lora add each row's delta from its own h; add_layer_norm's shrink makes the
h of the projection that reads its output. Against the fp32 reference, base rows bit for bit as without LoRA, and
in a CUDA graph replayed with a new mix of adapters. GPU only."""
from __future__ import annotations

import pytest
import torch

from engine.graphs import capture
from kernels import reference as ref
from kernels.site_lora import SiteLora
from tests.kernels.gpu import DEV, check, gen, lora_inputs, needs_ops, ops, randn

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
    w_ext = torch.cat([w, A.reshape(-1, d_in)])  # A of (slot, part, rank) after the weight
    return x, x @ w_ext.T, A, Bt, idx, rank_t


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n, d", [(1, 1024), (129, 1024), (300, 4096), (17, 64)])
def test_add_layer_norm_adds_each_rows_delta_from_its_own_h(dtype, n, d):
    x, y_ext, A, Bt, idx, rank_t = stacked_projection(n, 1, 256, d, dtype, 7 + n)
    g = gen(8)
    residual, w, b = randn(n, d, dtype=dtype, g=g), randn(d, dtype=dtype, g=g), randn(d, dtype=dtype, g=g)
    before = y_ext.clone()
    h, normed = ops.add_layer_norm(residual, y_ext, w, b, 1e-5, delta=SiteLora(Bt, idx, rank_t))
    assert torch.equal(y_ext, before)  # read, not written
    h_ref, normed_ref = ref.add_layer_norm(residual.float(), y_ext.float(), w.float(), b.float(), 1e-5,
                                           delta=SiteLora(Bt.float(), idx, rank_t))
    check(h, h_ref, dtype, "add_layer_norm's h with a LoRA delta")
    check(normed, normed_ref, dtype, "add_layer_norm with a LoRA delta")
    untouched = (idx == 0) | (rank_t[idx] == 0)  # base rows and adapters that skip the site: as without LoRA
    h_plain, normed_plain = ops.add_layer_norm(residual, y_ext[:, :d], w, b, 1e-5)
    assert torch.equal(h[untouched], h_plain[untouched]) and torch.equal(normed[untouched], normed_plain[untouched])


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
    delta = SiteLora(Bt, idx, rank_t) if with_delta else None
    x_in = y_ext if with_delta else y_ext[:, :d]
    h, normed = ops.add_layer_norm(residual, x_in, w, b, 1e-5, delta=delta, shrink=SiteLora(A, idx, rank_t))
    h_plain, normed_plain = ops.add_layer_norm(residual, x_in, w, b, 1e-5, delta=delta)
    slots, _, rank_max, _ = A.shape
    assert normed.shape == (n, d + slots * rank_max)
    assert torch.equal(h, h_plain) and torch.equal(normed[:, :d], normed_plain)
    _, want = ref.add_layer_norm(residual.float(), x_in.float(), w.float(), b.float(), 1e-5,
                                 delta=SiteLora(Bt.float(), idx, rank_t) if with_delta else None,
                                 shrink=SiteLora(A.float(), idx, rank_t))
    own = torch.zeros(n, slots, rank_max, dtype=torch.bool, device=DEV)
    for row, slot in enumerate(idx.tolist()):
        own[row, slot, :rank_t[slot]] = slot > 0
    ext = normed[:, d:].view(n, slots, rank_max)
    assert not ext[~own].any()  # other slots, ranks past the slot's and base rows: exactly 0
    check(ext.float(), want[:, d:].view(n, slots, rank_max), dtype, "add_layer_norm shrink")


@needs_ops
def test_add_layer_norm_checks_the_stacked_width_and_the_shrink():
    x, y_ext, A, Bt, idx, rank_t = stacked_projection(4, 1, 64, 64, torch.bfloat16, 9)
    residual, w, b = y_ext[:, :64].contiguous(), y_ext[0, :64].contiguous(), y_ext[1, :64].contiguous()
    with pytest.raises(ValueError, match="expected"):
        ops.add_layer_norm(residual, y_ext[:, :-16], w, b, 1e-5, delta=SiteLora(Bt, idx, rank_t))
    with pytest.raises(ValueError, match="ranks"):
        ops.add_layer_norm(residual, y_ext, w, b, 1e-5, delta=SiteLora(Bt, idx, rank_t.long()))
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.add_layer_norm(residual, None, w, b, 1e-5, shrink=SiteLora(A[:, :, :8].contiguous(), idx, rank_t))
    with pytest.raises(ValueError, match="same tensor"):
        ops.add_layer_norm(residual, y_ext, w, b, 1e-5, delta=SiteLora(Bt, idx, rank_t),
                           shrink=SiteLora(A, idx.clone(), rank_t))
    with pytest.raises(ValueError, match="differ"):
        ops.add_layer_norm(residual, y_ext, w, b, 1e-5, delta=SiteLora(Bt, idx, rank_t),
                           shrink=SiteLora(A[:, :, :16].contiguous(), idx, rank_t))


@needs_ops
def test_lora_norm_in_a_graph_reads_slots_and_weights_at_replay():
    """Captured once, the launch serves any later mix: slots, ranks, Bt and A are read at replay."""
    ranks, n, d = [0, 16, 8, 0, 16], 33, 1024
    x, y_ext, A_prev, Bt, idx, rank_t = stacked_projection(n, 1, 256, d, torch.bfloat16, 11, ranks)
    _, _, A, _, _, _ = stacked_projection(n, 1, d, d, torch.bfloat16, 21, ranks)
    g = gen(12)
    residual, w, b = randn(n, d, dtype=torch.bfloat16, g=g), randn(d, dtype=torch.bfloat16, g=g), randn(d, g=g)
    b = b.bfloat16()
    graph, out = capture(lambda: ops.add_layer_norm(residual, y_ext, w, b, 1e-5, delta=SiteLora(Bt, idx, rank_t),
                                                    shrink=SiteLora(A, idx, rank_t)), None)
    idx.copy_(torch.randint(0, len(ranks), (n,), device=DEV, generator=g))  # a new mix of adapters
    Bt[3, :, :4] = randn(1, 4, d, dtype=Bt.dtype, g=g, scale=0.05)  # an adapter installed after the capture
    A[3, :, :4] = randn(1, 4, d, dtype=A.dtype, g=g, scale=d ** -0.5)
    rank_t[3] = 4
    graph.replay()
    torch.cuda.synchronize()
    _, want = ref.add_layer_norm(residual.float(), y_ext.float(), w.float(), b.float(), 1e-5,
                                 delta=SiteLora(Bt.float(), idx, rank_t), shrink=SiteLora(A.float(), idx, rank_t))
    check(out[1][:, :d], want[:, :d], torch.bfloat16, "replay: normed")
    slots = len(ranks)
    check(out[1][:, d:].float().view(n, slots, -1), want[:, d:].view(n, slots, -1), torch.bfloat16, "replay: h")


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_append_lora_adds_each_rows_delta_then_appends_k_and_v(dtype):
    n, H, T, D = 40, 16, 12, 64
    x, y_ext, A, Bt, idx, rank_t = stacked_projection(n, 3, 1024, H * D, dtype, 13)
    g = gen(14)
    k_cache, v_cache = randn(n, H, T, D, dtype=dtype, g=g), randn(n, H, T, D, dtype=dtype, g=g)
    rows, positions = torch.randperm(n, device=DEV, generator=g), torch.randint(0, T, (n,), device=DEV, generator=g)
    original, want_k, want_v = y_ext.clone(), k_cache.float(), v_cache.float()
    qkv = ops.kv_append_lora(k_cache, v_cache, rows, positions, y_ext, SiteLora(Bt, idx, rank_t))
    q_ref = ref.kv_append_lora(want_k, want_v, rows, positions, original.float(), SiteLora(Bt.float(), idx, rank_t))
    check(qkv, q_ref, dtype, "kv_append_lora q|k|v")
    check(k_cache, want_k, dtype, "kv_append_lora k cache")
    check(v_cache, want_v, dtype, "kv_append_lora v cache")
    untouched = (idx == 0) | (rank_t[idx] == 0)
    assert torch.equal(qkv[untouched], original[untouched, :3 * H * D])  # base rows: the projection as it is
