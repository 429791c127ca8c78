"""The LoRA kernels of kernels/ops_lora.py (lora_tiles, lora_apply in its cluster, mma and CUDA-core kernels)
against the PyTorch reference, in a CUDA graph replayed with a new mix of adapters, and the rule by which
"auto" picks a kernel. GPU only; the decoder step's LoRA (add_layer_norm, kv_append_lora) is test_lora_step.py."""
from __future__ import annotations

import pytest
import torch

from kernels import reference as ref
from tests.kernels.gpu import DEV, SIZES, check, gen, lora_inputs, needs_ops, ops, ops_lora, poison_allocator, randn

pytestmark = pytest.mark.gpu


def lora_reference_fp32(y, x, A, Bt, idx, ranks):
    want = y.float().clone()
    ref.lora_apply(want, x.float(), A.float(), Bt.float(), idx, ranks, ref.lora_tiles(idx, A.shape[0]))
    return want


def lora_kernel(y, x, A, Bt, idx, ranks, tiles=None):
    out = y.clone()
    ops.lora_apply(out, x, A, Bt, idx, ranks, ops.lora_tiles(idx, A.shape[0]) if tiles is None else tiles)
    return out


# ops_lora.LORA_KERNEL for 16-bit shapes both tensor-core kernels take: "cluster" (sm_90; elsewhere the mma kernel
# runs) or "mma". fp32 runs the CUDA-core kernel whatever the switch says, so it is tried once.
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
    (2, 256, 384),  # cluster: 2 of its 16-column steps a block, 24 output pairs over 32 warps (some idle)
    (1, 48, 80),  # mma but not cluster (I, O not multiples of 128)
    (1, 8192, 2176),  # cluster: two column passes a block; two clusters a tile, 3 pairs a warp, the last warps idle
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
def test_lora_apply_cluster_kernel_takes_records_in_turns(monkeypatch):
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
    """So the tests above really compare two kernels: the cluster kernel where it can run and is asked for, else
    the mma kernel; "auto" takes the cluster kernel while its N // 16 + S tile records take at most
    LORA_CL_ROUNDS turns of the clusters the GPU holds at once (a q|k|v site: 3 a record)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the cluster kernel needs sm_90")
    from kernels import loader
    launched = []
    cluster, lo = "lora_apply_cluster_bf16", ops_lora
    active = loader.max_active_clusters(cluster, (1, 1, 8), (lo.LORA_CL_WARPS * 32,), lo._lora_cluster_smem(1024), 0)
    assert lo._SM_COUNT // 8 <= active <= lo.LORA_CL_RESIDENT * lo._SM_COUNT // 8  # the driver's answer
    limit = ops_lora.LORA_CL_ROUNDS * (active // 3)  # q|k|v records "auto" leaves to the cluster kernel
    # (2 slots: N // 16 + 2 records)
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


