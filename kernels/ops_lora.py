"""CUDA kernels for LoRA (kernels/cuda/lora.cu), part of the ops API that kernels/ops.py exports: same names and
signatures as kernels/reference.py's lora_tiles and lora_apply, which state the semantics and are the oracle.
The conventions are kernels/ops.py's."""
from __future__ import annotations

import math

import torch

from kernels import loader
from kernels.checks import dtype_suffix, need_contiguous, need_index, need_like, need_shape, need_tensor, vec8
from kernels.limits import LORA_MAX_RANK, LORA_MAX_SLOTS, LORA_OPT
from kernels.loader import i32, launch, ptr
from kernels.reference import LORA_RECORD, LORA_TILE  # the tile record's layout: lora.cu's

_SM_COUNT = loader.device_properties()[0]
_CLUSTERS = loader.sm90()  # thread-block clusters
LORA_THREADS, LORA_MMA_WARPS = 256, 16  # lora.cu
LORA_LDS, LORA_BLD = 2048 + 8, 64 + 8  # lora.cu: shared row strides of the mma kernel's x and A, and Bt
LORA_MMA_SMEM = (2 * 16 * LORA_LDS * 2 + LORA_MMA_WARPS * 16 * 16 * 4 + 2 * 16 * 16 * 2  # bytes, 16-bit types
                 + LORA_MMA_WARPS * 16 * LORA_BLD * 2)
# lora_cluster.cu: blocks a cluster, warps a block, input columns a block and pass, most 16-output pairs a warp,
# most rank passes
LORA_CLUSTER, LORA_CL_WARPS, LORA_CL_IC, LORA_CL_PAIRS, LORA_CL_PASSES = 8, 4, 512, 4, 4
LORA_CL_RESIDENT = 4  # cluster blocks an SM holds at once: 128 registers x 128 threads (nvcc -Xptxas -v)
# Which tensor-core kernel takes a 16-bit launch both can run (sm_90, I and O multiples of 128). "auto", by
# rule: the cluster kernel while the launch's tile records (N // 16 + S, used or not) take at most
# LORA_CL_ROUNDS turns of the clusters the GPU holds at once, else the mma kernel. Few records (a short
# prefill) leave most SMs idle under the mma kernel's one block a tile, and the cluster kernel spreads each
# tile over 8 SMs (fc2 at 256 rows, 1 adapter: 6.3 against 12.6 us); thousands of rows fill every SM either
# way, and there the mma kernel's single staging wins (q|k|v at 8192 rows: 111 against 208 us).
# "cluster" or "mma" force one (the GPU tests run both; bench.kernels times both).
LORA_KERNEL = "auto"
LORA_CL_ROUNDS = 4


def _lora_cluster_smem(d_in: int) -> int:
    """Bytes of the cluster version's dynamic shared memory (16-bit types): x and A [16][ld] with
    ld = min(I/8, LORA_CL_IC) + 8, the warps' and the rank passes' partial h [16][16] fp32, h's hi and lo
    [16][16], each warp's Bt block [16][LORA_BLD]."""
    ld = min(d_in // LORA_CLUSTER, LORA_CL_IC) + 8
    return (2 * 16 * ld * 2 + (LORA_CL_WARPS + LORA_CL_PASSES) * 16 * 16 * 4 + 2 * 16 * 16 * 2
            + LORA_CL_WARPS * 16 * LORA_BLD * 2)


def _lora_apply_cluster(sfx: str, y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor,
                        tiles: torch.Tensor, ranks: torch.Tensor, d_in: int, d_out: int, rank_max: int,
                        parts: int) -> bool:
    """lora_apply's cluster launch (checked arguments), with as many clusters along the records as the GPU
    holds at once; False (nothing launched) when "auto" leaves these records to the mma kernel."""
    name, block, smem = f"lora_apply_cluster_{sfx}", (LORA_CL_WARPS * 32,), _lora_cluster_smem(d_in)
    clusters = math.ceil(d_out / (LORA_CLUSTER * LORA_CL_WARPS * LORA_CL_PAIRS * 16))  # a warp's pairs fit
    fallback = LORA_CL_RESIDENT * _SM_COUNT // LORA_CLUSTER
    active = loader.max_active_clusters(name, (1, 1, LORA_CLUSTER), block, smem, fallback)
    per_round, records = max(1, active // (parts * clusters)), tiles.shape[0]
    if LORA_KERNEL == "auto" and records > LORA_CL_ROUNDS * per_round:
        return False
    args = (ptr(y), ptr(x), ptr(A), ptr(Bt), ptr(tiles), i32(records), ptr(ranks), i32(d_in), i32(d_out),
            i32(rank_max), i32(parts))
    launch(name, (min(records, per_round), parts, LORA_CLUSTER * clusters), block, args, shared_mem=smem)
    return True


def lora_tiles(idx: torch.Tensor, slots: int) -> torch.Tensor:
    """Semantics: the adapted rows grouped into tiles of at most LORA_TILE rows of one adapter slot
    (record [row0..row15, slot, count, 0...]; count 0: unused); built once per forward pass and shared
    by every lora_apply of it. Rows of slot 0 (or outside 1..slots-1) get no tile. One block, no host read.
    Shape: idx [N] int64; out [N // LORA_TILE + slots, 32] int32"""
    n = idx.numel()
    need_index("idx", idx, n)
    if not 1 <= slots <= LORA_MAX_SLOTS:
        raise ValueError(f"slots={slots}: expected 1 to {LORA_MAX_SLOTS} (the adapter slots plus slot 0)")
    tiles = torch.empty(n // LORA_TILE + slots, LORA_RECORD, dtype=torch.int32, device=idx.device)
    launch("lora_tiles", (1,), (1024,), (ptr(idx), i32(n), i32(slots), i32(tiles.shape[0]), ptr(tiles)),
           shared_mem=3 * 4 * slots)
    return tiles


def lora_apply(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor,
               idx: torch.Tensor, ranks: torch.Tensor, tiles: torch.Tensor) -> None:
    """Semantics: gathered LoRA, in place: for each token n with adapter slot s = idx[n] > 0 and each
    part p, y[n, p*O:(p+1)*O] += Bt[s, p, :r].T @ (A[s, p, :r] @ x[n]) with r = ranks[s]; fp32 sums,
    y rounded once (16-bit storage of whole 16x16 tiles runs on tensor cores, carrying h as two 16-bit
    halves: ~16 bits of mantissa; on sm_90 with I and O multiples of 128 a tile's work is split over a
    cluster of 8 blocks, the clusters the GPU holds at once taking the records in turns, while that takes
    few turns (LORA_KERNEL), else one block takes a tile; the two differ only in the order of the fp32
    sums). The kernel reads the rows through `tiles` (lora_tiles(idx, S)), not idx; A and Bt past a slot's
    rank are read and dropped, so they must be finite (the registry's stacks are zero there). Nothing is
    read on the host (graph-capturable); base rows cost nothing.
    Shape: y [N, P*O] contiguous, O a multiple of 4
    Shape: x [N, I] contiguous, I a multiple of 8
    Shape: A [S, P, R, I] contiguous
    Shape: Bt [S, P, R, O] contiguous
    Shape: idx [N] int64
    Shape: ranks [S] int32
    Shape: tiles [N // LORA_TILE + S, 32] int32"""
    sfx = dtype_suffix("y", y)
    for name, t in (("x", x), ("A", A), ("Bt", Bt)):
        need_like(name, t, y, "y")
        need_contiguous(name, t)
    need_contiguous("y", y)
    if A.dim() != 4 or Bt.dim() != 4:
        raise ValueError(f"A and Bt must be [S, P, R, I] and [S, P, R, O]; got {tuple(A.shape)}, {tuple(Bt.shape)}")
    slots, parts, rank_max, d_in = A.shape
    d_out = Bt.shape[3]
    need_shape("Bt", Bt, (slots, parts, rank_max, d_out))
    n = idx.numel()
    need_shape("x", x, (n, d_in))
    need_shape("y", y, (n, parts * d_out))
    need_index("idx", idx, n)
    need_tensor("ranks", ranks, torch.int32, (slots,))
    need_tensor("tiles", tiles, torch.int32, (n // LORA_TILE + slots, LORA_RECORD))
    if d_in % 8 or not (vec8(x) and vec8(A)):
        raise ValueError(f"x [N, {d_in}] and A need rows of a multiple of 8 elements on 16-byte boundaries")
    if d_out % LORA_OPT or y.data_ptr() % 16 or Bt.data_ptr() % 16:
        raise ValueError(f"y and Bt need rows of a multiple of {LORA_OPT} elements (O={d_out}) on 16-byte boundaries")
    if rank_max > LORA_MAX_RANK:
        raise ValueError(f"A holds rank {rank_max}; the kernel serves ranks up to {LORA_MAX_RANK}")
    if not n:
        return
    if LORA_KERNEL not in ("auto", "cluster", "mma"):
        raise ValueError(f"kernels.ops_lora.LORA_KERNEL={LORA_KERNEL!r}: expected 'auto', 'cluster' or 'mma'")
    mma = y.element_size() == 2 and d_in % 16 == 0 and d_out % 16 == 0 and rank_max % 16 == 0  # tensor cores
    split = 16 * LORA_CLUSTER  # the cluster's blocks take whole 16-column steps and 16-output pairs each
    if mma and _CLUSTERS and d_in % split == 0 and d_out % split == 0 and LORA_KERNEL != "mma":
        if _lora_apply_cluster(sfx, y, x, A, Bt, tiles, ranks, d_in, d_out, rank_max, parts):
            return
    args = (ptr(y), ptr(x), ptr(A), ptr(Bt), ptr(tiles), ptr(ranks), i32(d_in), i32(d_out), i32(rank_max), i32(parts))
    if mma:
        grid = (tiles.shape[0], parts, math.ceil(d_out / (LORA_MMA_WARPS * 64)))
        launch(f"lora_apply_mma_{sfx}", grid, (LORA_MMA_WARPS * 32,), args, shared_mem=LORA_MMA_SMEM)
    else:
        grid = (tiles.shape[0], parts, math.ceil(d_out / (LORA_THREADS * LORA_OPT)))
        launch(f"lora_apply_{sfx}", grid, (LORA_THREADS,), args)


def need_lora_cols(name: str, y_ext: torch.Tensor, Bt: torch.Tensor, idx: torch.Tensor, ranks: torch.Tensor,
                   d: int | None = None) -> tuple[int, int]:
    """Check a projection's output with its LoRA h after it (y_ext [N, P*O + P*S*R], the GEMM over the weight
    stacked on every slot's A; `d`: P*O where the caller knows it) against Bt, idx and ranks; returns (S, R)."""
    dtype_suffix(name, y_ext)
    need_like("Bt", Bt, y_ext, name)
    need_contiguous("Bt", Bt)
    if Bt.dim() != 4:
        raise ValueError(f"Bt must be [S, P, R, O]; got {tuple(Bt.shape)}")
    slots, parts, rank_max, d_out = Bt.shape
    n = y_ext.shape[0] if y_ext.dim() == 2 else -1
    width = parts * d_out + parts * slots * rank_max
    if y_ext.dim() != 2 or y_ext.shape[1] != width or (d is not None and d != parts * d_out):
        raise ValueError(f"{name} has shape {tuple(y_ext.shape)}; expected [N, {width}] (P*O = {parts * d_out} "
                         f"outputs, then h for P = {parts} parts, S = {slots} slots, R = {rank_max} ranks)")
    if y_ext.stride(1) != 1 or y_ext.stride(0) % 8 or not vec8(y_ext) or d_out % 8 or rank_max % 16:
        raise ValueError(f"{name} needs unit column stride and rows on 16-byte boundaries, O a multiple of 8 and R "
                         f"of 16; got strides {tuple(y_ext.stride())}, O={d_out}, R={rank_max}")
    need_index("idx", idx, n)
    need_tensor("ranks", ranks, torch.int32, (slots,))
    if rank_max > LORA_MAX_RANK:
        raise ValueError(f"Bt holds rank {rank_max}; the kernels serve ranks up to {LORA_MAX_RANK}")
    return slots, rank_max
