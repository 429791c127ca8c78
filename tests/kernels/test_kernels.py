"""Every CUDA kernel (kernels/ops.py) against its PyTorch reference, then timed at NLLB-600M sizes.

GPU only (`pytest -m gpu tests/kernels`); skipped cleanly where kernels.ops cannot import (no CuPy or
no CUDA). Like llm.c's dev/cuda: each kernel is validated on fresh random inputs (one row, odd sizes,
a full table, mixed lengths, bf16 and fp32) before it is timed. Outputs are allocated from poisoned
(NaN-filled) memory, so an element the kernel forgot to write fails the finiteness check.
"""
from __future__ import annotations

import itertools
import json
import math
import os
from functools import partial as P

import pytest
import torch

from engine.graphs import capture
from kernels import reference as ref
from kernels import reference_selection as ref_sel

try:
    from kernels import ops, ops_lora, ops_selection
    OPS_ERROR: Exception | None = None
except Exception as exc:  # noqa: BLE001 - reported by test_ops_import on a GPU machine
    ops, ops_lora, ops_selection, OPS_ERROR = None, None, None, exc

pytestmark = pytest.mark.gpu
needs_ops = pytest.mark.skipif(ops is None, reason=f"kernels.ops unavailable: {OPS_ERROR}")

DTYPES = [torch.bfloat16, torch.float32]
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5, torch.float16: 2e-3}
DEV = "cuda"


def test_ops_import():
    """On a machine with CUDA the kernels must import (compile); elsewhere this is a skip."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if OPS_ERROR is not None:
        raise OPS_ERROR


# ---- helpers -------------------------------------------------------------------------------------
def poison_allocator(nbytes: int = 64 << 20) -> None:
    """Fill free cached blocks with NaN so outputs of torch.empty start out non-finite."""
    for size in (nbytes, 1 << 20, 64 << 10, 4 << 10):
        t = torch.empty(size // 4, dtype=torch.float32, device=DEV)
        t.fill_(float("nan"))
        del t


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    o, w = out.double(), want.double()
    return float((o - w).norm() / w.norm().clamp_min(1e-30))


def check(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str, tol: float | None = None) -> None:
    assert out.shape == want.shape, f"{what}: shape {tuple(out.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite output (unwritten element or NaN)"
    err = rel_err(out, want)
    assert err <= (tol or TOL[dtype]), f"{what}: relative error {err:.3g} > {tol or TOL[dtype]}"


def gen(seed: int) -> torch.Generator:
    return torch.Generator(DEV).manual_seed(seed)


def randn(*shape, dtype=torch.float32, g=None, scale=1.0):
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)


def split_heads_strided(n: int, h: int, d: int, dtype, g, parts: int = 3):
    """q, k, v as the engine makes them: views into one fused projection [N, parts*H*D]."""
    fused = randn(n, parts * h * d, dtype=dtype, g=g)
    return [t.view(n, h, d) for t in fused.split(h * d, dim=-1)]


SIZES = [1, 3, 17, 129]


# ---- embed / add_layer_norm ---------------------------------------------------------------------------
@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("d", [64, 1024])
def test_embed(dtype, n, d):
    g = gen(n * 7 + d)
    V, P = 1000, 300
    table, pos = randn(V, d, dtype=dtype, g=g), randn(P, d, dtype=dtype, g=g)
    ids = torch.randint(0, V, (n,), device=DEV, generator=g)
    positions = torch.randint(0, P, (n,), device=DEV, generator=g)
    poison_allocator()
    out = ops.embed(ids, positions, table, pos, math.sqrt(d))
    want = ref.embed(ids, positions, table, pos, math.sqrt(d))
    check(out, want, dtype, "embed", tol=1e-6)  # same roundings as the reference: (near) exact


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("d", [64, 1024, 2048])
@pytest.mark.parametrize("with_x", [True, False])
def test_add_layer_norm(dtype, n, d, with_x):
    g = gen(n * 11 + d + with_x)
    residual = randn(n, d, dtype=dtype, g=g, scale=3.0)
    x = randn(n, d, dtype=dtype, g=g) if with_x else None
    w, b = randn(d, dtype=dtype, g=g), randn(d, dtype=dtype, g=g)
    poison_allocator()
    h, normed = ops.add_layer_norm(residual, x, w, b, 1e-5)
    h_ref, normed_ref = ref.add_layer_norm(residual, x, w, b, 1e-5)
    check(h, h_ref, dtype, "add_layer_norm h", tol=1e-6)
    check(normed, normed_ref, dtype, "add_layer_norm normed")
    if not with_x:
        assert h.data_ptr() == residual.data_ptr()  # x None: h is the residual itself, as in the reference


@needs_ops
def test_add_layer_norm_refuses_rows_it_cannot_read_in_pieces_of_8():
    w = torch.ones(60, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.add_layer_norm(randn(2, 60, dtype=torch.bfloat16, g=gen(2)), None, w, w, 1e-5)


@needs_ops
def test_add_layer_norm_nan_propagates():
    residual = randn(4, 1024, dtype=torch.bfloat16, g=gen(1))
    residual[2, 7] = float("nan")
    w, b = torch.ones(1024, dtype=torch.bfloat16, device=DEV), torch.zeros(1024, dtype=torch.bfloat16, device=DEV)
    _, normed = ops.add_layer_norm(residual, residual.clone(), w, b, 1e-5)
    _, normed_ref = ref.add_layer_norm(residual, residual.clone(), w, b, 1e-5)
    assert torch.isnan(normed[2]).all() and torch.isnan(normed_ref[2]).all()
    assert torch.isfinite(normed[[0, 1, 3]]).all()


# ---- kv_append -------------------------------------------------------------------------------------
@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("hd", [(4, 16), (16, 64)])
def test_kv_append(dtype, n, hd):
    H, D = hd
    g = gen(n * 13 + D)
    R, T = n + 3, 33
    k_cache, v_cache = randn(R, H, T, D, dtype=dtype, g=g), randn(R, H, T, D, dtype=dtype, g=g)
    rows = torch.randperm(R, device=DEV, generator=g)[:n]
    positions = torch.randint(0, T, (n,), device=DEV, generator=g)
    _, k, v = split_heads_strided(n, H, D, dtype, g)
    kc, vc = k_cache.clone(), v_cache.clone()
    ops.kv_append(kc, vc, rows, positions, k, v)
    ref.kv_append(k_cache, v_cache, rows, positions, k, v)
    assert torch.equal(kc, k_cache) and torch.equal(vc, v_cache)


# ---- attention ------------------------------------------------------------------------------------------
def decode_inputs(n, H, T, D, dtype, g, full=False):
    R = n + 2
    k_cache, v_cache = randn(R, H, T, D, dtype=dtype, g=g), randn(R, H, T, D, dtype=dtype, g=g)
    rows = torch.randint(0, R, (n,), device=DEV, generator=g)
    lengths = torch.full((n,), T, device=DEV) if full else torch.randint(1, T + 1, (n,), device=DEV, generator=g)
    lengths[0] = T
    if n > 1:
        lengths[1] = 1
    q, _, _ = split_heads_strided(n, H, D, dtype, g)
    return q, k_cache, v_cache, rows, lengths


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES + [300])
@pytest.mark.parametrize("htd", [(4, 33, 16), (16, 256, 64)])
def test_decode_attention(dtype, n, htd):
    H, T, D = htd
    g = gen(n * 17 + T)
    q, k_cache, v_cache, rows, lengths = decode_inputs(n, H, T, D, dtype, g)
    poison_allocator()
    out = ops.decode_attention(q, k_cache, v_cache, rows, lengths, D ** -0.5)
    want = ref.decode_attention(q, k_cache, v_cache, rows, lengths, D ** -0.5)
    check(out, want, dtype, f"decode_attention plan={ops.attention_plan(n * H, T, D)}")


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plan", [(1, 1, 1 << 30), (4, 1, 1 << 30), (4, 3, 32), (4, 8, 32), (1, 5, 16)])
def test_attention_every_plan(dtype, plan):
    """The same inputs through every (warps per item, splits, chunk) layout the planner can pick."""
    n, H, T, D = 9, 4, 130, 64
    g = gen(sum(plan))
    q, k_cache, v_cache, rows, lengths = decode_inputs(n, H, T, D, dtype, g)
    wpi, splits, chunk = plan
    if splits > 1:
        chunk = max(chunk, math.ceil(T / splits))
        splits = math.ceil(T / chunk)
    poison_allocator()
    out = ops._attention(q, k_cache, v_cache, H * T * D, T * D, D, rows, lengths, None, 0, T, D ** -0.5,
                         split_override=(wpi, splits, chunk))
    want = ref.decode_attention(q, k_cache, v_cache, rows, lengths, D ** -0.5)
    check(out, want, dtype, f"attention plan {plan}")


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 17, 300])
def test_decode_attention_reads_keys_through_the_history_table(dtype, n):
    """Beam cache indirection: position t of row r comes from row history[r, t]."""
    H, T, D = 4, 70, 16
    g = gen(n + 7)
    q, k_cache, v_cache, rows, lengths = decode_inputs(n, H, T, D, dtype, g)
    R = k_cache.shape[0]
    history = torch.randint(0, R, (R, T), device=DEV, generator=g, dtype=torch.int32)
    out = ops.decode_attention(q, k_cache, v_cache, rows, lengths, D ** -0.5, history=history)
    want = ref.decode_attention(q, k_cache, v_cache, rows, lengths, D ** -0.5, history=history)
    check(out, want, dtype, "decode_attention through history")
    for plan in ((4, 3, 32), (1, 2, 64), (1, 1, 1 << 30)):  # chunks starting past 0; past 64 keys (T = 70)
        out = ops._attention(q, k_cache, v_cache, H * T * D, T * D, D, rows, lengths, None, 0, T, D ** -0.5,
                             split_override=plan, history=history)
        check(out, want, dtype, f"decode_attention through history, plan {plan}")
    plain = ref.decode_attention(q, k_cache, v_cache, rows, lengths, D ** -0.5)
    assert not torch.allclose(want.float(), plain.float(), atol=1e-2)  # the table really redirects


@needs_ops
def test_decode_attention_nan_propagates():
    g = gen(3)
    q, k_cache, v_cache, rows, lengths = decode_inputs(5, 4, 33, 16, torch.float32, g)
    q[2, 1, 3] = float("nan")
    v_cache[rows[4], 0, 0, 5] = float("nan")  # position 0 is inside every row's range
    out = ops.decode_attention(q, k_cache, v_cache, rows, lengths, 0.25)
    want = ref.decode_attention(q, k_cache, v_cache, rows, lengths, 0.25)
    assert torch.isnan(out[2, 1]).all() and torch.isnan(want[2, 1]).all()
    assert torch.isnan(out[4, 0, 5]) and torch.isnan(want[4, 0, 5])
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(out), finite)
    assert rel_err(out[finite], want[finite]) < 1e-5


def cross_inputs(n_segments, beams, H, D, dtype, g, max_src=120, fixed=False):
    lens = torch.randint(1, max_src + 1, (n_segments,), generator=torch.Generator().manual_seed(n_segments)).tolist()
    lens[0] = max_src
    if fixed:
        lens = [max_src] * n_segments
    starts, s = [], 7  # the pool does not start at 0, and has free space between segments
    for ln in lens:
        starts.append(s)
        s += ln + 3
    P = s + 5
    k_pool, v_pool = randn(P, H, D, dtype=dtype, g=g), randn(P, H, D, dtype=dtype, g=g)
    starts_t = torch.tensor(starts, device=DEV).repeat_interleave(beams)
    lens_t = torch.tensor(lens, device=DEV).repeat_interleave(beams)
    q, _, _ = split_heads_strided(len(starts_t), H, D, dtype, g)
    return q, k_pool, v_pool, starts_t, lens_t, max(lens)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("segments_beams", [(1, 1), (3, 1), (17, 1), (4, 4), (129, 1), (64, 4)])
@pytest.mark.parametrize("hd", [(4, 16), (16, 64)])
@pytest.mark.parametrize("give_max_len", [False, True])
def test_cross_attention(dtype, segments_beams, hd, give_max_len):
    H, D = hd
    segs, beams = segments_beams
    g = gen(segs * 19 + beams + D)
    q, k_pool, v_pool, starts, lens, max_len = cross_inputs(segs, beams, H, D, dtype, g)
    poison_allocator()
    out = ops.cross_attention(q, k_pool, v_pool, starts, lens, D ** -0.5, max_len=max_len if give_max_len else None)
    want = ref.cross_attention(q, k_pool, v_pool, starts, lens, D ** -0.5)
    check(out, want, dtype, "cross_attention")


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 17, 129])
@pytest.mark.parametrize("hd", [(4, 16), (16, 64)])
def test_encoder_attention(dtype, batch, hd):
    H, D = hd
    g = gen(batch * 23 + D)
    lens = torch.randint(1, 121, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    lens[0] = 1
    if batch > 1:
        lens[1] = 120
    cu = [0]
    for ln in lens:
        cu.append(cu[-1] + ln)
    q, k, v = split_heads_strided(cu[-1], H, D, dtype, g)
    poison_allocator()
    out = ops.encoder_attention(q, k, v, cu, D ** -0.5)
    want = ref.encoder_attention(q, k, v, cu, D ** -0.5)
    check(out, want, dtype, "encoder_attention")


@needs_ops
def test_encoder_attention_long_sequence_splits():
    """One 1000-token source: few items, so the planner splits the keys (flash-decoding path)."""
    g = gen(29)
    q, k, v = split_heads_strided(1000, 16, 64, torch.bfloat16, g)
    out = ops.encoder_attention(q, k, v, [0, 1000], 0.125)
    check(out, ref.encoder_attention(q, k, v, [0, 1000], 0.125), torch.bfloat16, "encoder_attention long")


@needs_ops
@pytest.mark.parametrize("bound", [64, 128])
def test_encoder_attention_with_device_offsets_as_the_encoder_graph_pads_them(bound):
    """The encoder graph's layout: real sequences, then filler tokens as one-token sequences, then empty
    sequences up to one per token; cu_seqlens on the device, a power-of-two bound on the lengths."""
    lens = [5, 33, 1, 60]
    real = sum(lens)
    n = 128
    cu = [0]
    for ln in lens + [1] * (n - real):
        cu.append(cu[-1] + ln)
    cu += [n] * (n + 1 - len(cu))
    q, k, v = split_heads_strided(n, 16, 64, torch.bfloat16, gen(31))
    out = ops.encoder_attention(q, k, v, torch.tensor(cu, device=DEV), 0.125, max_len=bound)
    want = ref.encoder_attention(q, k, v, cu[:len(lens) + 1], 0.125)
    check(out[:real], want[:real], torch.bfloat16, "encoder_attention, device offsets")
    assert torch.isfinite(out).all()


# ---- token selection -----------------------------------------------------------------------------------
def logits_inputs(n, V, dtype, g):
    x = randn(n, V, dtype=torch.float32, g=g, scale=3.0)
    x[:, ::97] = float("-inf")  # banned tokens (processors) are -inf
    return x.to(dtype)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES + [1024])
@pytest.mark.parametrize("V", [1000, 256206])
def test_greedy_select(dtype, n, V):
    g = gen(n * 31 + V)
    x = logits_inputs(n, V, dtype, g)
    poison_allocator()
    token, logprob = ops.greedy_select(x)
    want_token, want_logprob = ref_sel.greedy_select(x)
    xf = x.float()
    first_max = (xf == xf.max(-1, keepdim=True).values).float().argmax(-1)  # ties: the first index
    assert torch.equal(token, first_max)
    assert torch.equal(token, want_token) or dtype == torch.bfloat16  # bf16 may tie; checked above
    assert torch.isfinite(logprob).all()
    torch.testing.assert_close(logprob, want_logprob, atol=1e-4, rtol=1e-5)


@needs_ops
def test_greedy_select_nan():
    x = logits_inputs(3, 5000, torch.float32, gen(37))
    x[1, 4321] = float("nan")
    token, logprob = ops.greedy_select(x)
    want_token, want_logprob = ref_sel.greedy_select(x)
    assert int(token[1]) == int(want_token[1]) == 4321  # NaN ranks highest, as torch.argmax
    assert torch.isnan(logprob[1]) and torch.isnan(want_logprob[1])
    assert torch.isfinite(logprob[[0, 2]]).all()


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_select_edge_rows(dtype):
    """NaN, -inf-only stretches and ties where the vector loop's batch shortcut could miss them (two chunks a
    row at this size): the first NaN wins and makes the log-softmax NaN; ties go to the first index."""
    x = logits_inputs(6, 5000, dtype, gen(39))
    nan, inf = float("nan"), float("inf")
    x[0, 4321] = nan  # in the second chunk
    x[1, :] = -inf
    x[1, 10] = nan  # among -inf only: nothing summed before it
    x[2, :] = -inf  # argmax 0, log-softmax NaN (as torch)
    x[3, [100, 3000, 4999]] = 50.0  # a tie over batches and chunks
    x[4, [7, 4000]] = nan  # the first of two
    x[5, :4096] = -inf  # a first chunk of -inf, then finite logits
    token, logprob = ops.greedy_select(x)
    want_token, want_logprob = ref_sel.greedy_select(x)
    assert token.tolist() == [4321, 10, 0, 100, 7, int(want_token[5])]
    assert torch.equal(torch.isnan(logprob), torch.isnan(want_logprob))
    assert torch.isnan(logprob[[0, 1, 2, 4]]).all()
    torch.testing.assert_close(logprob[[3, 5]], want_logprob[[3, 5]], atol=1e-4, rtol=1e-5)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES + [1024])
@pytest.mark.parametrize("V", [1000, 256206])
@pytest.mark.parametrize("k", [1, 8, 10, 128])
def test_topk_logprobs(dtype, n, V, k):
    g = gen(n * 41 + V + k)
    x = logits_inputs(n, V, dtype, g)
    poison_allocator()
    values, indices = ops.topk_logprobs(x, k)
    want_values, _ = ref_sel.topk_logprobs(x, k)
    assert torch.isfinite(values).all()
    torch.testing.assert_close(values, want_values, atol=1e-4, rtol=1e-5)
    # the indices point at those values, are distinct, and ties come lower index first
    lp = torch.log_softmax(x.float(), -1)
    torch.testing.assert_close(lp.gather(1, indices), want_values, atol=1e-4, rtol=1e-5)
    assert all(len(set(r)) == k for r in indices.tolist())
    tie = values[:, 1:] == values[:, :-1]
    assert bool((indices[:, 1:][tie] > indices[:, :-1][tie]).all())


@needs_ops
def test_topk_logprobs_nan_row():
    x = logits_inputs(3, 5000, torch.float32, gen(43))
    x[1, 17] = float("nan")
    values, indices = ops.topk_logprobs(x, 8)
    want_values, _ = ref_sel.topk_logprobs(x, 8)
    assert torch.isnan(values[1]).all() and torch.isnan(want_values[1]).all()
    torch.testing.assert_close(values[[0, 2]], want_values[[0, 2]], atol=1e-4, rtol=1e-5)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 5, 300])
@pytest.mark.parametrize("V", [256206, 1003])
def test_selection_of_padded_rows_reads_them_in_vectors_and_stops_at_v(dtype, n, V):
    """The LM head's logits are a view of rows padded to 8 elements: the kernels read those in 16-byte vectors
    (chunks and the tail short of V included) and must not look past V, where the padding holds a winner."""
    g = gen(53 + n)
    padded = logits_inputs(n, V + 8 - V % 8 + 8, dtype, g)
    padded[:, V:] = 100.0  # past V: must never win
    x = padded[:, :V]
    assert x.stride(0) % 8 == 0
    token, logprob = ops.greedy_select(x)
    want_token, want_logprob = ref_sel.greedy_select(x)
    assert torch.equal(token, want_token)
    torch.testing.assert_close(logprob, want_logprob, atol=1e-4, rtol=1e-5)
    values, indices = ops.topk_logprobs(x, 8)
    want_values, _ = ref_sel.topk_logprobs(x, 8)
    torch.testing.assert_close(values, want_values, atol=1e-4, rtol=1e-5)
    assert (indices < V).all()


@needs_ops
def test_graph_capture():
    """The wrappers launch on torch's current stream: they are captured and replayed by torch.cuda.graph."""
    g = gen(47)
    q, k_cache, v_cache, rows, lengths = decode_inputs(16, 16, 256, 64, torch.bfloat16, g)
    x = logits_inputs(16, 256206, torch.float32, g)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as torch recommends before capture
        ops.decode_attention(q, k_cache, v_cache, rows, lengths, 0.125)
        ops.greedy_select(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.decode_attention(q, k_cache, v_cache, rows, lengths, 0.125)
        token, _ = ops.greedy_select(x)
    q.copy_(randn(*q.shape, dtype=q.dtype, g=g))
    x.copy_(logits_inputs(16, 256206, torch.float32, g))
    graph.replay()
    torch.cuda.synchronize()
    check(out, ref.decode_attention(q, k_cache, v_cache, rows, lengths, 0.125), torch.bfloat16, "graph replay")
    assert torch.equal(token, ref_sel.greedy_select(x)[0])


def layer_weights(d: int, g: torch.Generator) -> dict:
    """One decoder layer's self-attention and feed-forward weights (bf16), scaled to keep activations O(1)."""
    w = {name: randn(o, i, dtype=torch.bfloat16, g=g, scale=i ** -0.5)
         for name, (o, i) in {"qkv": (3 * d, d), "out": (d, d), "fc1": (4 * d, d), "fc2": (d, 4 * d)}.items()}
    w |= {f"{name}_b": randn(w[name].shape[0], dtype=torch.bfloat16, g=g, scale=0.1) for name in list(w)}
    w |= {f"ln{i}_{p}": randn(d, dtype=torch.bfloat16, g=g, scale=0.1) + (p == "w") for i in (1, 2, 3) for p in "wb"}
    return w


def one_row_layers(x, weights, k_cache, v_cache, rows, lengths):
    """A one-row decode step's chain through `weights` (a list of layer_weights): LayerNorm, q|k|v GEMV,
    KV append, attention, out GEMV, add + LayerNorm, fc1 (ReLU), fc2, add + LayerNorm, per layer.
    Shape: k_cache, v_cache [layers, R, H, T, D]"""
    H, D = k_cache.shape[2], k_cache.shape[4]
    _, h = ops.add_layer_norm(x, None, weights[0]["ln1_w"], weights[0]["ln1_b"], 1e-5)
    for layer, w in enumerate(weights):
        qkv = ops.linear(h, w["qkv"], w["qkv_b"]).view(1, 3, H, D)
        ops.kv_append(k_cache[layer], v_cache[layer], rows, lengths - 1, qkv[:, 1], qkv[:, 2])
        a = ops.decode_attention(qkv[:, 0], k_cache[layer], v_cache[layer], rows, lengths, D ** -0.5)
        residual, h = ops.add_layer_norm(h, ops.linear(a.view(1, H * D), w["out"], w["out_b"]), w["ln2_w"], w["ln2_b"],
                                         1e-5)
        f = ops.linear(ops.linear(h, w["fc1"], w["fc1_b"], relu=True), w["fc2"], w["fc2_b"])
        _, h = ops.add_layer_norm(residual, f, w["ln3_w"], w["ln3_b"], 1e-5)
    return h


@needs_ops
def test_programmatic_dependent_launch_in_a_graph_gives_the_results_of_plain_launches(monkeypatch):
    """Every kernel waits for the one before it (pdl_enter) before touching what that one writes or reads:
    a one-row chain of 6 layers replayed in a graph with the PDL attribute equals, bit for bit, the same
    chain captured without it, over replays on new inputs and a growing KV cache."""
    from kernels import loader
    g, d, H, T, layers = gen(61), 1024, 16, 64, 6
    weights = [layer_weights(d, g) for _ in range(layers)]
    x = randn(1, d, dtype=torch.bfloat16, g=g)
    rows, lengths = torch.tensor([1], device=DEV), torch.tensor([1], device=DEV)
    caches, outputs, graphs = {}, {}, {}
    for pdl in (True, False):
        monkeypatch.setattr(loader, "PDL", pdl)
        caches[pdl] = [randn(layers, 3, H, T, d // H, dtype=torch.bfloat16, g=gen(62)) for _ in "kv"]
        graphs[pdl], outputs[pdl] = capture(P(one_row_layers, x, weights, *caches[pdl], rows, lengths), None)
    for step in range(1, 9):
        x.copy_(randn(1, d, dtype=torch.bfloat16, g=g))
        lengths.fill_(step)
        for pdl in (True, False):
            graphs[pdl].replay()
        torch.cuda.synchronize()
        assert torch.isfinite(outputs[True]).all()
        assert torch.equal(outputs[True], outputs[False]), f"replay {step}"
    assert all(torch.equal(a, b) for a, b in zip(caches[True], caches[False]))


# ---- linear layers ------------------------------------------------------------------------------
@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16])
@pytest.mark.parametrize("dims", [(1024, 3072), (4096, 1024), (64, 40), (24, 7)])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("row_stride", [False, True])
def test_linear(dtype, m, dims, relu, with_bias, row_stride):
    """Up to 4 rows take the linear_rows kernels (each row bound; x and the weight contiguous, or each a column
    slice of a wider tensor, as the LoRA registry's weights are), more rows cuBLAS: the same semantics either way."""
    d_in, d_out = dims
    g = gen(79 + m)
    wide = d_in + 8 * row_stride
    x, w = randn(m, wide, dtype=dtype, g=g), randn(d_out, wide, dtype=dtype, g=g, scale=d_in ** -0.5)
    x, w = x[:, :d_in], w[:, :d_in]
    b = randn(d_out, dtype=dtype, g=g) if with_bias else None
    want = ref.linear(x.float(), w.float(), None if b is None else b.float(), relu)
    poison_allocator()
    out = ops.linear(x, w, b, relu)
    check(out, want, torch.bfloat16, "linear")  # bf16 tolerance: the output is rounded once
    if relu:
        assert bool((out >= 0).all())


@needs_ops
@pytest.mark.parametrize("ksplit", [1, 2, 4, 8])
@pytest.mark.parametrize("m, dims", [(1, (4096, 1024)), (2, (1024, 3072)), (3, (4096, 40)), (4, (8192, 24)),
                                     (1, (24, 7))])
def test_linear_rows_give_the_same_result_however_the_columns_are_split(ksplit, m, dims, monkeypatch):
    monkeypatch.setattr(ops, "GEMV_KSPLIT", ksplit)
    d_in, d_out = dims
    assert ops.gemv_takes(m, d_in)
    g = gen(87 + m)
    x, w = randn(m, d_in, dtype=torch.bfloat16, g=g), randn(d_out, d_in, dtype=torch.bfloat16, g=g, scale=d_in ** -0.5)
    b = randn(d_out, dtype=torch.bfloat16, g=g)
    poison_allocator()
    check(ops.linear(x, w, b, relu=True), ref.linear(x.float(), w.float(), b.float(), True), torch.bfloat16, "linear")


@needs_ops
@pytest.mark.parametrize("rows, with_bias", [(1, False), (1, True), (4, True), (16, False), (16, True)])  # GEMV, cuBLAS
def test_linear_propagates_nan_through_relu(rows, with_bias):
    x, w = randn(rows, 64, dtype=torch.bfloat16, g=gen(83)), randn(16, 64, dtype=torch.bfloat16, g=gen(84))
    w[3, 5] = float("nan")
    b = randn(16, dtype=torch.bfloat16, g=gen(85)) if with_bias else None
    out = ops.linear(x, w, b, relu=True)
    assert torch.isnan(out[:, 3]).all() and torch.isfinite(out[:, torch.arange(16, device=DEV) != 3]).all()


# ---- LoRA ----------------------------------------------------------------------------------------------
def lora_inputs(n, slots, parts, rank_max, d_in, d_out, dtype, g, ranks):
    """Stacks of `slots` adapters (slot 0 = base) with the given per-slot ranks and token slots drawn
    over every slot (base rows included). The stacks are NOT zero past each rank: the op must stop at
    ranks[s] by itself."""
    A = randn(slots, parts, rank_max, d_in, dtype=dtype, g=g, scale=0.05)
    Bt = randn(slots, parts, rank_max, d_out, dtype=dtype, g=g, scale=0.05)
    rank_t = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    idx = torch.randint(0, slots, (n,), device=DEV, generator=g)
    x = randn(n, d_in, dtype=dtype, g=g)
    y = randn(n, parts * d_out, dtype=dtype, g=g)
    return y, x, A, Bt, idx, rank_t


def lora_reference_fp32(y, x, A, Bt, idx, ranks):
    want = y.float().clone()
    ref.lora_apply(want, x.float(), A.float(), Bt.float(), idx, ranks, ref.lora_tiles(idx, A.shape[0]))
    return want


def lora_kernel(y, x, A, Bt, idx, ranks, tiles=None):
    out = y.clone()
    ops.lora_apply(out, x, A, Bt, idx, ranks, ops.lora_tiles(idx, A.shape[0]) if tiles is None else tiles)
    return out


# ops_lora.LORA_KERNEL for 16-bit shapes both tensor-core versions take: "cluster" (v9, sm_90; elsewhere v7 runs)
# or "mma" (v7). fp32 runs the CUDA-core version whatever the switch says, so it is tried once.
LORA_KERNELS = ["cluster", "mma"]
LORA_DTYPE_KERNELS = [pytest.param(dt, k, id=f"{str(dt).removeprefix('torch.')}-{k}")
                      for dt, k in [(torch.bfloat16, "cluster"), (torch.bfloat16, "mma"), (torch.float16, "cluster"),
                                    (torch.float16, "mma"), (torch.float32, "cluster")]]


def tile_summary(tiles, idx):
    """Per slot: its rows (sorted) and its tiles' sizes (sorted); checks each used record holds rows of its slot."""
    rows, sizes = {}, {}
    for rec in tiles.tolist():
        count, slot = rec[ref.LORA_TILE + 1], rec[ref.LORA_TILE]
        if count == 0:
            continue
        assert 1 <= count <= ref.LORA_TILE and all(int(idx[r]) == slot for r in rec[:count])
        rows.setdefault(slot, []).extend(rec[:count])
        sizes.setdefault(slot, []).append(count)
    return {s: sorted(r) for s, r in rows.items()}, {s: sorted(c) for s, c in sizes.items()}


@needs_ops
@pytest.mark.parametrize("dtype, kernel", LORA_DTYPE_KERNELS)
@pytest.mark.parametrize("n", SIZES + [300])
@pytest.mark.parametrize("parts_dims", [
    (1, 64, 64), (3, 1024, 1024), (1, 1024, 4096), (1, 4096, 1024), (2, 24, 40),
    (2, 256, 384),  # v9: 2 of its 16-column steps a block, 24 output pairs over 32 warps (some idle)
    (1, 48, 80),  # v7 but not v9 (I, O not multiples of 128)
    (1, 8192, 2176),  # v9: two column passes a block; two clusters a tile, 3 pairs a warp, the last warps idle
])
def test_lora_apply_mixed_adapters(dtype, kernel, n, parts_dims, monkeypatch):
    monkeypatch.setattr(ops_lora, "LORA_KERNEL", kernel)
    parts, d_in, d_out = parts_dims
    ranks = [0, 16, 4, 1, 0, 64, 7]  # base, full and odd ranks, an adapter that skips this site
    y, x, A, Bt, idx, rank_t = lora_inputs(n, len(ranks), parts, 64, d_in, d_out, dtype, gen(61 + n), ranks)
    want = lora_reference_fp32(y, x, A, Bt, idx, rank_t)
    poison_allocator()
    out = lora_kernel(y, x, A, Bt, idx, rank_t)
    check(out, want, dtype, "lora_apply")
    untouched = (idx == 0) | (rank_t[idx] == 0)
    assert torch.equal(out[untouched], y[untouched])  # base rows and skipped sites are not rewritten


@needs_ops
@pytest.mark.parametrize("n, slots", [(0, 3), (1, 2), (5, 9), (77, 5), (300, 33), (8192, 9), (1000, 1)])
def test_lora_tiles_kernel_puts_every_adapted_row_in_one_tile_of_its_slot(n, slots):
    g = gen(59 + n)
    idx = torch.randint(0, slots, (n,), device=DEV, generator=g)
    idx[: n // 3] = torch.randint(-1, slots + 2, (n // 3,), device=DEV, generator=g)  # out-of-range: no tile
    got, want = ops.lora_tiles(idx, slots), ref.lora_tiles(idx, slots)
    assert got.shape == want.shape == (n // ref.LORA_TILE + slots, 32)
    assert tile_summary(got, idx) == tile_summary(want, idx)  # the same rows in the same number of tiles


@needs_ops
@pytest.mark.parametrize("dtype, kernel", [p for p in LORA_DTYPE_KERNELS if p.values[0] != torch.float16])
def test_lora_apply_result_does_not_depend_on_how_rows_are_tiled(dtype, kernel, monkeypatch):
    monkeypatch.setattr(ops_lora, "LORA_KERNEL", kernel)
    y, x, A, Bt, idx, rank_t = lora_inputs(77, 5, 2, 16, 1024, 512, dtype, gen(59), [0, 16, 3, 16, 9])
    reference_tiles = ref.lora_tiles(idx, 5)  # rows ascending within a slot; the kernel's order is the atomics'
    assert torch.equal(lora_kernel(y, x, A, Bt, idx, rank_t, reference_tiles), lora_kernel(y, x, A, Bt, idx, rank_t))


@needs_ops
@pytest.mark.parametrize("kernel", LORA_KERNELS)
def test_lora_apply_matches_the_reference_in_its_own_dtype(kernel, monkeypatch):
    monkeypatch.setattr(ops_lora, "LORA_KERNEL", kernel)
    y, x, A, Bt, idx, rank_t = lora_inputs(129, 9, 3, 16, 1024, 1024, torch.bfloat16, gen(67), [0] + [16] * 8)
    out, want = lora_kernel(y, x, A, Bt, idx, rank_t), y.clone()
    ref.lora_apply(want, x, A, Bt, idx, rank_t, ref.lora_tiles(idx, 9))  # the CPU path's arithmetic: bf16
    check(out, want, torch.bfloat16, "lora_apply vs bf16 reference", tol=2e-2)


@needs_ops
def test_lora_apply_cluster_version_takes_records_in_turns(monkeypatch):
    """More tile records than the GPU holds clusters: each cluster takes every X-th record to the end."""
    monkeypatch.setattr(ops_lora, "LORA_KERNEL", "cluster")
    ranks = [0, 16, 5, 16, 0, 9]
    y, x, A, Bt, idx, rank_t = lora_inputs(3001, len(ranks), 3, 16, 1024, 1024, torch.bfloat16, gen(83), ranks)
    out = lora_kernel(y, x, A, Bt, idx, rank_t)  # 193 records, ~7 turns at 3 parts
    check(out, lora_reference_fp32(y, x, A, Bt, idx, rank_t), torch.bfloat16, "lora_apply in turns")
    untouched = (idx == 0) | (rank_t[idx] == 0)
    assert torch.equal(out[untouched], y[untouched])


@needs_ops
def test_lora_apply_launches_the_kernel_the_switch_picks(monkeypatch):
    """So the tests above really compare two kernels: v9 where it can run and is asked for, else v7; "auto"
    takes v9 while its N // 16 + S tile records take at most LORA_CL_ROUNDS turns of the clusters the GPU
    holds at once (a q|k|v site: 3 a record)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the cluster version needs sm_90")
    from kernels import loader
    launched = []
    cluster, lo = "lora_apply_cluster_bf16", ops_lora
    active = loader.max_active_clusters(cluster, (1, 1, 8), (lo.LORA_CL_WARPS * 32,), lo._lora_cluster_smem(1024), 0)
    assert lo._SM_COUNT // 8 <= active <= lo.LORA_CL_RESIDENT * lo._SM_COUNT // 8  # the driver's answer
    limit = ops_lora.LORA_CL_ROUNDS * (active // 3)  # q|k|v records "auto" leaves to v9 (2 slots: N // 16 + 2 records)
    for kernel, n, (parts, d_in, d_out), want in (("cluster", 5, (3, 1024, 1024), cluster),
                                                  ("mma", 5, (3, 1024, 1024), "lora_apply_mma_bf16"),
                                                  ("cluster", 5, (1, 48, 80), "lora_apply_mma_bf16"),
                                                  ("auto", 5, (3, 1024, 1024), cluster),
                                                  ("auto", (limit - 2) * 16, (3, 1024, 1024), cluster),
                                                  ("auto", (limit - 1) * 16, (3, 1024, 1024), "lora_apply_mma_bf16")):
        y, x, A, Bt, idx, rank_t = lora_inputs(n, 2, parts, 16, d_in, d_out, torch.bfloat16, gen(79), [0, 16])
        tiles = ops.lora_tiles(idx, 2)
        monkeypatch.setattr(ops_lora, "LORA_KERNEL", kernel)
        with monkeypatch.context() as m:
            m.setattr(ops_lora, "launch", lambda name, *args, **kwargs: launched.append(name))
            ops.lora_apply(y, x, A, Bt, idx, rank_t, tiles)
        assert launched.pop() == want


@needs_ops
def test_lora_apply_rejects_misaligned_input():
    y, x, A, Bt, idx, rank_t = lora_inputs(4, 2, 1, 4, 24, 8, torch.float32, gen(71), [0, 4])
    tiles = ops.lora_tiles(idx, 2)
    with pytest.raises(ValueError, match="ranks"):
        ops.lora_apply(y, x, A, Bt, idx, rank_t.long(), tiles)
    with pytest.raises(ValueError, match="tiles"):
        ops.lora_apply(y, x, A, Bt, idx, rank_t, tiles[:1])
    with pytest.raises(ValueError, match="multiple of 4"):
        ops.lora_apply(y[:, :6].contiguous(), x, A, Bt[..., :6].contiguous(), idx, rank_t, tiles)
    y, x, A, Bt, idx, rank_t = lora_inputs(4, 2, 1, 4, 12, 8, torch.float32, gen(71), [0, 4])
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.lora_apply(y, x, A, Bt, idx, rank_t, tiles)


@needs_ops
@pytest.mark.parametrize("kernel", LORA_KERNELS)
def test_lora_apply_in_a_graph_reads_slots_and_weights_at_replay(kernel, monkeypatch):
    """Captured once, the launch serves any later mix: slots and adapter weights are read at replay."""
    monkeypatch.setattr(ops_lora, "LORA_KERNEL", kernel)
    g = gen(73)
    y, x, A, Bt, idx, rank_t = lora_inputs(33, 5, 3, 16, 1024, 1024, torch.bfloat16, g, [0, 16, 8, 0, 16])
    base = y.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.lora_apply(y, x, A, Bt, idx, rank_t, ops.lora_tiles(idx, 5))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.lora_apply(y, x, A, Bt, idx, rank_t, ops.lora_tiles(idx, 5))
    idx.copy_(torch.randint(0, 5, (33,), device=DEV, generator=g))  # a new mix of adapters
    A[3, :, :4] = randn(3, 4, 1024, dtype=A.dtype, g=g, scale=0.05)  # an adapter installed after capture
    Bt[3, :, :4] = randn(3, 4, 1024, dtype=A.dtype, g=g, scale=0.05)
    rank_t[3] = 4
    y.copy_(base)
    graph.replay()
    torch.cuda.synchronize()
    check(y, lora_reference_fp32(base, x, A, Bt, idx, rank_t), torch.bfloat16, "lora_apply replay")


# ---- timings at NLLB-600M sizes (validated first) --------------------------------------------------------
def cuda_time(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of fn() over `iters` runs, CUDA events around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def graph_time(fn, calls: int = 10, replays: int = 20) -> float:
    """Milliseconds per fn() when `calls` of them replay in one CUDA graph (no launch overhead)."""
    graph, _ = capture(lambda: [fn() for _ in range(calls)], None)
    return cuda_time(graph.replay, iters=replays) / calls


@needs_ops
def test_timings(capsys, monkeypatch):
    d, H, D, T, V = 1024, 16, 64, 256, 256206
    bf = torch.bfloat16
    g = gen(53)
    rows_out = []

    def record(name, size, fn, ref_fn, nbytes):
        ms = cuda_time(fn)
        ref_ms = cuda_time(ref_fn) if ref_fn is not None else float("nan")
        rows_out.append(dict(kernel=name, size=size, us=ms * 1e3, ref_us=ref_ms * 1e3,
                             gbps=nbytes / (ms * 1e-3) / 1e9 if nbytes else float("nan")))

    table, pos = randn(V, d, dtype=bf, g=g), randn(1026, d, dtype=bf, g=g)
    for n in (16, 1024):
        ids = torch.randint(0, V, (n,), device=DEV, generator=g)
        p = torch.randint(2, 200, (n,), device=DEV, generator=g)
        check(ops.embed(ids, p, table, pos, 32.0), ref.embed(ids, p, table, pos, 32.0), bf, "embed")
        record("embed", f"N={n}", P(ops.embed, ids, p, table, pos, 32.0),
               P(ref.embed, ids, p, table, pos, 32.0), 3 * n * d * 2)
    w, b = randn(d, dtype=bf, g=g), randn(d, dtype=bf, g=g)
    for n in (16, 1024, 32768):
        r, x = randn(n, d, dtype=bf, g=g), randn(n, d, dtype=bf, g=g)
        check(ops.add_layer_norm(r, x, w, b, 1e-5)[1], ref.add_layer_norm(r, x, w, b, 1e-5)[1], bf, "add_layer_norm")
        record("add_layer_norm", f"N={n}", P(ops.add_layer_norm, r, x, w, b, 1e-5),
               P(ref.add_layer_norm, r, x, w, b, 1e-5), 4 * n * d * 2)
    for n in (16, 256, 1024):
        q, kc, vc, rows, _ = decode_inputs(n, H, T, D, bf, g, full=True)
        rows = torch.arange(n, device=DEV)
        _, k, v = split_heads_strided(n, H, D, bf, g)
        pos_t = torch.full((n,), T - 1, device=DEV)
        record("kv_append", f"N={n}", P(ops.kv_append, kc, vc, rows, pos_t, k, v),
               P(ref.kv_append, kc, vc, rows, pos_t, k, v), 4 * n * H * D * 2)
        for fill in ("full", "half"):
            lengths = torch.full((n,), T if fill == "full" else T // 2, device=DEV)
            check(ops.decode_attention(q, kc, vc, rows, lengths, 0.125),
                  ref.decode_attention(q, kc, vc, rows, lengths, 0.125), bf, "decode_attention")
            kv_bytes = 2 * n * H * (T if fill == "full" else T // 2) * D * 2
            record("decode_attention", f"N={n} len={T if fill == 'full' else T // 2}",
                   P(ops.decode_attention, q, kc, vc, rows, lengths, 0.125),
                   P(ref.decode_attention, q, kc, vc, rows, lengths, 0.125), kv_bytes)
        del kc, vc
    for segs, beams in ((16, 1), (1024, 1), (256, 4)):
        q, kp, vp, starts, lens, max_len = cross_inputs(segs, beams, H, D, bf, g, max_src=32, fixed=True)
        check(ops.cross_attention(q, kp, vp, starts, lens, 0.125), ref.cross_attention(q, kp, vp, starts, lens, 0.125),
              bf, "cross_attention")
        record("cross_attention", f"N={segs * beams} src=32", P(ops.cross_attention, q, kp, vp, starts, lens, 0.125),
               P(ref.cross_attention, q, kp, vp, starts, lens, 0.125), 2 * segs * 32 * H * D * 2)
    for batch, slen in ((16, 32), (1024, 32), (64, 120)):
        cu = [i * slen for i in range(batch + 1)]
        q, k, v = split_heads_strided(cu[-1], H, D, bf, g)
        check(ops.encoder_attention(q, k, v, cu, 0.125), ref.encoder_attention(q, k, v, cu, 0.125), bf,
              "encoder_attention")

        def sdpa(q, k, v, cu):  # the alternative: torch SDPA, one launch per sequence
            out = torch.empty_like(q)
            for s, e in zip(cu[:-1], cu[1:]):
                out[s:e] = torch.nn.functional.scaled_dot_product_attention(
                    q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), scale=0.125).transpose(0, 1)
            return out
        check(sdpa(q, k, v, cu), ref.encoder_attention(q, k, v, cu, 0.125), bf, "sdpa")
        record("encoder_attention", f"B={batch} S={slen} (ref_us = SDPA per sequence)",
               P(ops.encoder_attention, q, k, v, cu, 0.125), P(sdpa, q, k, v, cu), 4 * cu[-1] * H * D * 2)
    for n in (16, 256, 1024):
        x = logits_inputs(n, V, torch.float32, g)
        tok, lp = ops.greedy_select(x)
        assert torch.equal(tok, ref_sel.greedy_select(x)[0])
        record("greedy_select", f"N={n} fp32", P(ops.greedy_select, x), P(ref_sel.greedy_select, x),
               n * V * 4)
        head = logits_inputs(n, V + 8 - V % 8, bf, g)[:, :V]  # the LM head's bf16 rows, padded: 16-byte reads
        assert torch.equal(ops.greedy_select(head)[0], ref_sel.greedy_select(head)[0])
        record("greedy_select", f"N={n} bf16, padded rows", P(ops.greedy_select, head),
               P(ref_sel.greedy_select, head), n * V * 2)
        for k in (8, 128):
            vals, _ = ops.topk_logprobs(x, k)
            torch.testing.assert_close(vals, ref_sel.topk_logprobs(x, k)[0], atol=1e-4, rtol=1e-5)
            record("topk_logprobs", f"N={n} k={k} fp32", P(ops.topk_logprobs, x, k),
                   P(ref_sel.topk_logprobs, x, k), n * V * 4)
        del x
    for n in (1, 16, 64):  # sampled rows; torch us: the reference, a row at a time as the engine ran it before
        x = logits_inputs(n, V, torch.float32, g)
        for (k, p), clusters in itertools.product(((50, 1.0), (50, 0.9), (0, 0.9)), (None, False)):
            warp_args = (torch.ones(n, device=DEV), torch.full((n,), k, device=DEV),
                         torch.full((n,), p, device=DEV, dtype=torch.float64))
            monkeypatch.setattr(ops_selection, "SAMPLE_CLUSTERS", clusters)
            record("sampling_warp", f"N={n} top-k {k} top-p {p} {'auto' if clusters is None else 'one block'}",
                   P(ops.sampling_warp, x, *warp_args), P(ref_sel.sampling_warp, x, *warp_args), n * V * 4)
        monkeypatch.setattr(ops_selection, "SAMPLE_CLUSTERS", None)
        ids = torch.randint(0, 64, (n, 64), device=DEV, generator=g)
        every = torch.full((n,), 1, device=DEV)
        proc_args = (torch.arange(n, device=DEV), ids, every * 64, torch.full((n,), 1.3, device=DEV), every * 3,
                     every, 2)
        record("apply_processors", f"N={n} t=64 penalty, 3-grams", P(ops.apply_processors, x, *proc_args),
               P(ref_sel.apply_processors, x, *proc_args), 0)
        del x
    for rows, (d_in, d_out) in itertools.product((1, 4), ((d, d), (d, 3 * d), (d, 4 * d), (4 * d, d))):  # GEMV
        x, w, bias = randn(rows, d_in, dtype=bf, g=g), randn(d_out, d_in, dtype=bf, g=g), randn(d_out, dtype=bf, g=g)
        check(ops.linear(x, w, bias), ref.linear(x.float(), w.float(), bias.float()), bf, "linear")
        cublas_us = graph_time(P(torch.nn.functional.linear, x, w, bias)) * 1e3
        for ksplit in (None, 1, 2, 4, 8):  # None: the one gemv_split picks
            monkeypatch.setattr(ops, "GEMV_KSPLIT", ksplit)
            us = graph_time(P(ops.linear, x, w, bias)) * 1e3
            rows_out.append(dict(kernel="linear", size=f"M={rows} {d_in}->{d_out} ksplit {ksplit or 'auto'}, graph",
                                 us=us, ref_us=cublas_us, gbps=d_in * d_out * 2 / (us * 1e-6) / 1e9))
        monkeypatch.setattr(ops, "GEMV_KSPLIT", None)
    from kernels import loader  # a one-row step's chain of 12 layers, with and without programmatic launch
    weights, x = [layer_weights(d, g) for _ in range(12)], randn(1, d, dtype=bf, g=g)
    caches = [randn(12, 2, H, 64, D, dtype=bf, g=g) for _ in "kv"]
    one, forty = torch.tensor([1], device=DEV), torch.tensor([40], device=DEV)
    chain_us = {}
    for pdl in (True, False):
        monkeypatch.setattr(loader, "PDL", pdl)
        chain_us[pdl] = graph_time(P(one_row_layers, x, weights, *caches, one, forty), calls=1) * 1e3
    rows_out.append(dict(kernel="12 layers (PDL)", size="M=1, 40 keys, in a graph; torch us: no PDL",
                         us=chain_us[True], ref_us=chain_us[False], gbps=float("nan")))
    monkeypatch.setattr(loader, "PDL", None)
    del weights, caches
    sites = {"q|k|v": (3, d, d), "fc1": (1, d, 4 * d), "fc2": (1, 4 * d, d)}
    for (site, (parts, d_in, d_out)), (n, adapters) in itertools.product(
            sites.items(), ((1, 1), (256, 1), (256, 32), (8192, 8))):  # decode rows; a prefill of 256 x 32 tokens
        slots = 33  # the engine's registry at the bench's 32 adapters: N // 16 + 33 tile records, most unused
        y, x, A, Bt, idx, rank_t = lora_inputs(n, slots, parts, 16, d_in, d_out, bf, g, [0] + [16] * (slots - 1))
        idx = torch.arange(n, device=DEV) % adapters + 1  # every row adapted, adapters interleaved
        tiles = ops.lora_tiles(idx, slots)
        for kernel, version in (("cluster", "v9"), ("mma", "v7")):  # the A/B: the graph captures the switch's pick
            monkeypatch.setattr(ops_lora, "LORA_KERNEL", kernel)  # (y as the previous timing left it: checked anew)
            check(lora_kernel(y, x, A, Bt, idx, rank_t), lora_reference_fp32(y, x, A, Bt, idx, rank_t), bf,
                  f"lora_apply {version}")
            us = graph_time(P(ops.lora_apply, y, x, A, Bt, idx, rank_t, tiles)) * 1e3
            rows_out.append(dict(kernel=f"lora {version} {site} r16", size=f"N={n}, {adapters} adapters, in a graph",
                                 us=us, ref_us=float("nan"), gbps=float("nan")))
        del y, x, A, Bt
    with capsys.disabled():
        print(f"\n{'kernel':<18} {'size':<44} {'us':>9} {'torch us':>10} {'GB/s':>8}")
        for r in rows_out:
            print(f"{r['kernel']:<18} {r['size']:<44} {r['us']:>9.1f} {r['ref_us']:>10.1f} {r['gbps']:>8.0f}")
    out = os.environ.get("KERNEL_TIMINGS_JSON")
    if out:
        with open(out, "w") as f:
            json.dump(rows_out, f, indent=1)
