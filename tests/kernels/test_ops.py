"""The kernels of kernels/ops.py (embedding, LayerNorm, linear layers, KV cache, attention) against their
PyTorch references, and their launches captured in CUDA graphs, with and without programmatic launch.
GPU only (`pytest -m gpu tests/kernels`); skipped where kernels.ops cannot import."""
from __future__ import annotations

import math
from functools import partial as P

import pytest
import torch

from engine.graphs import capture
from kernels import reference as ref
from kernels import reference_selection as ref_sel
from kernels.checks import SUFFIX
from tests.kernels.gpu import (DEV, DTYPES, OPS_ERROR, SIZES, check, gen, logits_inputs, needs_ops, ops,
                               poison_allocator, randn, rel_err, split_heads_strided)

pytestmark = pytest.mark.gpu


def test_ops_import():
    """On a machine with CUDA the kernels must import (compile); elsewhere this is a skip."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if OPS_ERROR is not None:
        raise OPS_ERROR


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
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 17, 300])
@pytest.mark.parametrize("with_history", [False, True])
@pytest.mark.parametrize("D", [16, 64])
def test_decode_attention_appends_the_keys_it_attends(dtype, n, with_history, D):
    """new_kv: one launch writes each row's key and value at lengths - 1 and attends over them. Under every plan
    (splits whose range holds the new position included, through a history table too) the caches and the output
    equal, bit for bit, kv_append then decode_attention under the same plan, and the fp32 reference (heads of 64
    take the kernels with their layout compiled in)."""
    H, T = 4, 70
    g = gen(n + 31)
    q, k_cache, v_cache, _, lengths = decode_inputs(n, H, T, D, dtype, g)
    R = k_cache.shape[0]
    rows = torch.randperm(R, device=DEV, generator=g)[:n]  # distinct, as the engine's rows are
    _, k_new, v_new = split_heads_strided(n, H, D, dtype, g)  # views into one q|k|v, as the engine's
    history = None
    if with_history:  # as the engine's: no position written in this step is read through another row's table
        history = torch.randint(0, R, (R, T), device=DEV, generator=g, dtype=torch.int32)
        written_at = torch.full((R,), -1, device=DEV)
        written_at[rows] = lengths - 1
        positions = torch.arange(T, device=DEV)[None, :]
        history = torch.where(written_at[history.long()] == positions, torch.arange(R, device=DEV)[:, None],
                              history).to(torch.int32)
        history[rows, lengths - 1] = rows.to(torch.int32)  # a row's current position is its own
    k_two, v_two = k_cache.clone(), v_cache.clone()
    ref.kv_append(k_two, v_two, rows, lengths - 1, k_new, v_new)  # on the GPU's tensors
    k_ref, v_ref = k_cache.float(), v_cache.float()
    want = ref.decode_attention(q.float(), k_ref, v_ref, rows, lengths, D ** -0.5, history=history,
                                new_kv=(k_new.float(), v_new.float()))
    for plan in (None, (4, 3, 32), (1, 2, 64), (1, 1, 1 << 30), (4, 1, 1 << 30)):
        k_c, v_c = k_cache.clone(), v_cache.clone()
        args = (H * T * D, T * D, D, rows, lengths, None, 0, T, D ** -0.5)
        out = ops._attention(q, k_c, v_c, *args, split_override=plan, history=history, new_kv=(k_new, v_new))
        two = ops._attention(q, k_two, v_two, *args, split_override=plan, history=history)
        assert torch.equal(k_c, k_two) and torch.equal(v_c, v_two), f"caches, plan {plan}"
        assert torch.equal(out, two), f"plan {plan}"
        check(out, want, dtype, f"decode_attention with new_kv, plan {plan}")
    k_c, v_c = k_cache.clone(), v_cache.clone()
    out = ops.decode_attention(q, k_c, v_c, rows, lengths, D ** -0.5, history=history, new_kv=(k_new, v_new))
    assert torch.equal(k_c, k_two) and torch.equal(k_c.float(), k_ref) and torch.equal(v_c.float(), v_ref)
    check(out, want, dtype, "decode_attention with new_kv")


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", ops.ATTN_HEAD_SIZES if ops is not None else [])
@pytest.mark.parametrize("with_history", [False, True])
def test_attention_with_its_head_layout_compiled_in_equals_the_run_time_layout(dtype, D, with_history, monkeypatch):
    """The kernels for NLLB's head sizes (key groups, shuffles and strides fixed at compile time) against the ones
    that read the layout at run time, on the same inputs: the same bits, one warp an item and four, in one split and
    in several, and the fp32 reference. Ragged lengths (one with a last batch of a single key), a history table,
    and a NaN in a value that some ranges hold."""
    n, H, T = 37, 4, 70
    g = gen(D + n + with_history)
    q, k_cache, v_cache, rows, lengths = decode_inputs(n, H, T, D, dtype, g)
    R = k_cache.shape[0]
    history = torch.randint(0, R, (R, T), device=DEV, generator=g, dtype=torch.int32) if with_history else None
    lengths[2] = 33
    v_cache[int(history[rows[3], 0]) if with_history else int(rows[3]), 1, 0, 5] = float("nan")
    args = (H * T * D, T * D, D, rows, lengths, None, 0, T, D ** -0.5)
    want = ref.decode_attention(q, k_cache, v_cache, rows, lengths, D ** -0.5, history=history)
    assert want.isnan().any()
    for plan in ((1, 1, 1 << 30), (1, 2, 36), (4, 1, 1 << 30), (4, 3, 32)):
        compiled_in = ops._attention(q, k_cache, v_cache, *args, split_override=plan, history=history)
        with monkeypatch.context() as patch:
            patch.setattr(ops, "ATTN_HEAD_SIZES", ())
            run_time = ops._attention(q, k_cache, v_cache, *args, split_override=plan, history=history)
        assert torch.equal(compiled_in.isnan(), run_time.isnan()), f"plan {plan}"
        assert torch.equal(compiled_in.nan_to_num(), run_time.nan_to_num()), f"plan {plan}"
        assert torch.equal(compiled_in.isnan(), want.isnan()), f"plan {plan}"
        check(compiled_in.nan_to_num(), want.nan_to_num(), dtype, f"heads of {D}, plan {plan}")


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("append", [False, True])
def test_decode_attention_planned_for_a_bound_below_the_capacity_attends_every_key(dtype, append):
    """max_len plans the split in place of the capacity T: heads of 128 at a few rows split T = 256 keys in two (a
    combine launch) and 128 not at all, and either way every key up to each row's length is attended (the fp32
    reference, the step's own key appended or not)."""
    n, H, T, D = 3, 16, 256, 128
    assert ops.attention_plan(n * H, T, D)[1] == 2 and ops.attention_plan(n * H, 128, D)[1] == 1
    g = gen(77 + append)
    q, k_cache, v_cache, _, lengths = decode_inputs(n, H, T, D, dtype, g)
    rows = torch.randperm(k_cache.shape[0], device=DEV, generator=g)[:n]
    lengths = lengths.clamp(max=128)
    lengths[0] = 128
    new_kv = tuple(split_heads_strided(n, H, D, dtype, g)[1:]) if append else None
    k_want, v_want = k_cache.clone(), v_cache.clone()
    if append:
        ref.kv_append(k_want, v_want, rows, lengths - 1, *new_kv)
    want = ref.decode_attention(q.float(), k_want.float(), v_want.float(), rows, lengths, D ** -0.5)
    out = ops.decode_attention(q, k_cache, v_cache, rows, lengths, D ** -0.5, new_kv=new_kv, max_len=128)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)
    check(out, want, dtype, "decode_attention planned for 128 keys")


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
@pytest.mark.parametrize("segments_beams", [(33, 4), (64, 4), (129, 2), (200, 4)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("max_src", [32, 120])
def test_cross_attention_over_beam_runs_gives_the_bits_of_a_warp_a_row(dtype, segments_beams, D, max_src,
                                                                       monkeypatch):
    """A warp taking a beam segment's rows of one head (`group`) returns what one warp a row returns, to the bit,
    whether ranges fill the key batches or end inside them."""
    segs, beams = segments_beams
    H = 16
    g = gen(segs * 23 + beams + D + max_src)
    q, k_pool, v_pool, starts, lens, max_len = cross_inputs(segs, beams, H, D, dtype, g, max_src=max_src)
    apart = ops.cross_attention(q, k_pool, v_pool, starts, lens, D ** -0.5, max_len=max_len)
    launched, launch = [], ops.launch
    monkeypatch.setattr(ops, "launch", lambda name, *args: (launched.append(name), launch(name, *args))[1])
    poison_allocator()
    grouped = ops.cross_attention(q, k_pool, v_pool, starts, lens, D ** -0.5, max_len=max_len, group=beams)
    assert launched == [f"attn_group{D}q{beams}_{SUFFIX[dtype]}"]
    assert torch.equal(grouped, apart)
    check(grouped, ref.cross_attention(q, k_pool, v_pool, starts, lens, D ** -0.5), dtype, "cross_attention")


@needs_ops
@pytest.mark.parametrize("segments_beams", [(1, 4), (4, 4), (3, 2)])
def test_cross_attention_over_few_beam_runs_keeps_the_plan_of_few_items(segments_beams, monkeypatch):
    """Where the plan gives an item four warps (a sentence's beams) `group` changes nothing."""
    segs, beams = segments_beams
    q, k_pool, v_pool, starts, lens, max_len = cross_inputs(segs, beams, 16, 64, torch.bfloat16, gen(segs))
    launched, launch = [], ops.launch
    monkeypatch.setattr(ops, "launch", lambda name, *args: (launched.append(name), launch(name, *args))[1])
    out = ops.cross_attention(q, k_pool, v_pool, starts, lens, 0.125, max_len=max_len, group=beams)
    assert not any(name.startswith("attn_group") for name in launched)
    check(out, ref.cross_attention(q, k_pool, v_pool, starts, lens, 0.125), torch.bfloat16, "cross_attention")


@pytest.fixture(params=[True, False], ids=["flash", "attn"])
def encoder_kernel(request, monkeypatch):
    """encoder_attention's two paths for bf16: torch's FlashAttention over packed sequences, and attn_*."""
    if request.param and not ops.FLASH_ENCODER:
        pytest.skip("torch's FlashAttention does not run on this GPU (kernels/ops.py _probe_flash)")
    monkeypatch.setattr(ops, "FLASH_ENCODER", request.param)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 17, 129])
@pytest.mark.parametrize("hd", [(4, 16), (16, 64)])
def test_encoder_attention(dtype, batch, hd, encoder_kernel):
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
def test_encoder_attention_long_sequence_splits(encoder_kernel):
    """One 1000-token source: few items, so the planner splits the keys (flash-decoding path)."""
    g = gen(29)
    q, k, v = split_heads_strided(1000, 16, 64, torch.bfloat16, g)
    out = ops.encoder_attention(q, k, v, [0, 1000], 0.125)
    check(out, ref.encoder_attention(q, k, v, [0, 1000], 0.125), torch.bfloat16, "encoder_attention long")


@needs_ops
@pytest.mark.parametrize("bound", [64, 128])
def test_encoder_attention_with_device_offsets_as_the_encoder_graph_pads_them(bound, encoder_kernel):
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


@needs_ops
def test_programmatic_dependent_launch_in_a_graph_gives_the_results_of_plain_launches(monkeypatch):
    """Every kernel waits for the one before it (pdl_enter) before touching what that one writes or reads:
    a one-row chain of 6 layers replayed in a graph with the PDL attribute equals, bit for bit, the same
    chain captured without it, over replays on new inputs and a growing KV cache."""
    from bench.kernels import layer_weights, one_row_layers  # the chain bench.kernels times
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
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 33, 64, 65])
@pytest.mark.parametrize("dims", [(1024, 3072), (4096, 1024), (64, 40), (24, 7)])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("row_stride", [False, True])
def test_linear(dtype, m, dims, relu, with_bias, row_stride):
    """Up to 3 rows take the linear_rows kernels (each row bound), 4 to 16 linear_mma (each tile count), more rows
    cuBLAS; x and the weight contiguous, or each a column slice of a wider tensor, as the LoRA registry's weights
    are: the same semantics every way."""
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
@pytest.mark.parametrize("knob, m, dims", [
    ("GEMV_KSPLIT", 1, (4096, 1024)), ("GEMV_KSPLIT", 2, (1024, 3072)), ("GEMV_KSPLIT", 3, (4096, 40)),
    ("GEMV_KSPLIT", 4, (8192, 24)), ("GEMV_KSPLIT", 1, (24, 7)),
    ("MMA_KSPLIT", 4, (4096, 1024)), ("MMA_KSPLIT", 16, (1024, 3072)), ("MMA_KSPLIT", 13, (4096, 40)),
    ("MMA_KSPLIT", 16, (8192, 24)), ("MMA_KSPLIT", 9, (24, 7)), ("MMA_KSPLIT", 5, (1032, 1040))])
def test_linear_kernels_give_the_same_result_however_the_columns_are_split(ksplit, knob, m, dims, monkeypatch):
    from kernels import ops_linear  # imports only where the kernels do (needs_ops)
    monkeypatch.setattr(ops_linear, knob, ksplit)
    d_in, d_out = dims
    assert ops.gemv_takes(m, d_in) if knob == "GEMV_KSPLIT" else ops.mma_takes(m, d_in, d_out)
    g = gen(87 + m)
    x, w = randn(m, d_in, dtype=torch.bfloat16, g=g), randn(d_out, d_in, dtype=torch.bfloat16, g=g, scale=d_in ** -0.5)
    b = randn(d_out, dtype=torch.bfloat16, g=g)
    poison_allocator()
    check(ops.linear(x, w, b, relu=True), ref.linear(x.float(), w.float(), b.float(), True), torch.bfloat16, "linear")


@needs_ops
@pytest.mark.parametrize("ksplit", [1, 2, 8])
@pytest.mark.parametrize("m, dims", [(4, (4096, 1024)), (16, (2048, 2048)), (7, (8192, 72)), (13, (1032, 40))])
def test_linear_mma_gives_the_same_bits_with_4_or_8_chunks_a_batch(ksplit, m, dims, monkeypatch):
    """A part takes its chunks in the same order whatever the batch (mma_loads): the outputs are the same bits,
    and the reference's."""
    from kernels import ops_linear
    monkeypatch.setattr(ops_linear, "MMA_KSPLIT", ksplit)
    d_in, d_out = dims
    g = gen(89 + m)
    x, w = randn(m, d_in, dtype=torch.bfloat16, g=g), randn(d_out, d_in, dtype=torch.bfloat16, g=g, scale=d_in ** -0.5)
    b = randn(d_out, dtype=torch.bfloat16, g=g)
    out = {}
    for loads in (4, 8):
        monkeypatch.setattr(ops_linear, "MMA_LOADS", loads)
        poison_allocator()
        out[loads] = ops.linear(x, w, b, relu=True)
    assert torch.equal(out[4], out[8])
    check(out[8], ref.linear(x.float(), w.float(), b.float(), True), torch.bfloat16, "linear")


@needs_ops
@pytest.mark.parametrize("rows", [8, 9, 16])
def test_a_large_weight_leaves_linear_mma_above_8_rows_with_the_same_result(rows):
    """3.3B's q|k|v (2048 -> 6144) at 9 to 16 rows goes to cuBLAS (mma_takes), at 8 to linear_mma."""
    assert ops.mma_takes(rows, 2048, 6144) == (rows <= 8) and ops.mma_takes(rows, 1024, 4096)
    g = gen(101 + rows)
    x, w = randn(rows, 2048, dtype=torch.bfloat16, g=g), randn(6144, 2048, dtype=torch.bfloat16, g=g, scale=1 / 45)
    b = randn(6144, dtype=torch.bfloat16, g=g)
    check(ops.linear(x, w, b, relu=True), ref.linear(x.float(), w.float(), b.float(), True), torch.bfloat16, "linear")


@needs_ops
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_linear_mma_on_the_gemvs_rows_matches_the_reference(rows, monkeypatch):
    """linear_mma takes any row count from 1 (bench.kernels times it there against the GEMV)."""
    from kernels import ops_linear
    monkeypatch.setattr(ops_linear, "MMA_MIN_ROWS", 1)
    g = gen(97 + rows)
    x, w = randn(rows, 1024, dtype=torch.float16, g=g), randn(3072, 1024, dtype=torch.float16, g=g, scale=1 / 32)
    check(ops.linear(x, w, None), ref.linear(x.float(), w.float(), None), torch.float16, "linear")


@needs_ops
@pytest.mark.parametrize("rows, with_bias", [(1, False), (1, True), (4, True), (16, False), (16, True),
                                             (100, False), (100, True)])  # GEMV, linear_mma, cuBLAS
def test_linear_propagates_nan_through_relu(rows, with_bias):
    x, w = randn(rows, 64, dtype=torch.bfloat16, g=gen(83)), randn(16, 64, dtype=torch.bfloat16, g=gen(84))
    w[3, 5] = float("nan")
    b = randn(16, dtype=torch.bfloat16, g=gen(85)) if with_bias else None
    out = ops.linear(x, w, b, relu=True)
    assert torch.isnan(out[:, 3]).all() and torch.isfinite(out[:, torch.arange(16, device=DEV) != 3]).all()


