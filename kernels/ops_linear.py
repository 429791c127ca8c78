"""CUDA kernels for linear layers (kernels/cuda/gemv.cu, linear_mma.cu, and cuBLAS through torch), part of the
ops API that kernels/ops.py exports: same names and signatures as kernels/reference.py, which states the semantics
and is the oracle. The conventions are kernels/ops.py's."""
from __future__ import annotations

import math

import torch

from kernels import linear_triton
from kernels.checks import dtype_suffix, need_like, need_same, vec8
from kernels.loader import device_properties, i32, i64, launch, ptr, sm90


GEMV_WARPS, GEMV_OUT_PER_WARP, GEMV_SLOT, GEMV_LOADS = 8, 1, 256, 4  # kernels/cuda/gemv.cu
GEMV_ROW_BOUNDS = (1, 2, 4)  # the compiled linear_rows<MR> kernels
GEMV_KSPLIT: int | None = None  # None: gemv_split's choice (bench.kernels sweeps the others)
GEMV_FILL_WARPS = 4096  # warps a one-row layer wants in all (the H200's 132 SMs x 64 warps hold 8,448)
MMA_WARPS, MMA_CHUNK = 8, 32  # kernels/cuda/linear_mma.cu
MMA_ROW_TILES = (1, 2)  # the compiled linear_mma<NT> kernels (8 NT rows)
MMA_MIN_ROWS = 4  # fewer rows take the GEMV (bench.kernels lowers it to time linear_mma there)
MMA_MAX_ROWS = 8 * MMA_ROW_TILES[-1]
MMA_WIDE_MAX_WEIGHT = 8 << 20  # the largest weight (elements) that 9 to 16 rows take to linear_mma (mma_takes)
_MMA_COMPILED = sm90()
_SM_COUNT = device_properties()[0]
MMA_KSPLIT: int | None = None  # None: mma_split's choice (bench.kernels sweeps the others)
MMA_FILL_WARPS = 4096  # warps a layer wants in all (8, the most parts, for every NLLB layer)
MMA_LOADS: int | None = None  # None: mma_loads's choice (bench.kernels times both)


def gemv_split(d_in: int, d_out: int) -> int:
    """Warps that share an output's columns (1, 2, 4 or 8): the fewest that give the layer GEMV_FILL_WARPS warps,
    so that a narrow layer still spreads over every SM, and never more than its batches of loads. One row on the
    H200 (graph time): 600M's fc2 4096 -> 1024 3.3 us at 4 against 7.0 at 1 and 5.3 at 8; 3.3B's fc2 8192 -> 2048
    8.6 at 2 against 11.6 at 8, its fc1 2048 -> 8192 10.0 at 1 against 11.4 at 2, its q|k|v 8.3 at 1 against 8.6
    at 2 (more parts are more warps whose loads wait on each other's, and more sums to meet)."""
    if GEMV_KSPLIT is not None:
        return GEMV_KSPLIT
    batches = math.ceil(d_in / (GEMV_SLOT * GEMV_LOADS))
    return min(GEMV_WARPS, _pow2_at_least(batches), _pow2_at_least(math.ceil(GEMV_FILL_WARPS / max(d_out, 1))))


def _pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def gemv_takes(m: int, d_in: int) -> bool:
    """Whether m rows of d_in inputs go to the GEMV rather than cuBLAS: up to 4 (kernels/cuda/gemv.cu's
    timings; inside the decode step cuBLAS's small-M kernels cost more than alone, 7.1 us a 1024 -> 1024 at
    4 rows), where linear_mma does not take them first."""
    return m <= GEMV_ROW_BOUNDS[-1]


def mma_takes(m: int, d_in: int, d_out: int) -> bool:
    """Whether m rows go to linear_mma: 4 to 8 on sm_90, and 9 to 16 where the weight has at most
    MMA_WIDE_MAX_WEIGHT elements. In the engine on the H200 (docs/performance.md, "Linear layers"): one sentence
    beam 4 (4 rows) 18.1 -> 16.2 ms on 600M and 53 -> 40 ms on 3.3B, greedy B=16 +20% on 600M; one row stays on
    the GEMV (13.4 against 14.3 ms); 17 rows and more on cuBLAS, whose tiles reuse x where this kernel reads it
    once per 16 outputs. At 16 rows the two x tiles make a large weight's warps slower than cuBLAS (3.3B's
    2048 -> 6144 13.3 against 10.0 us, 8192 -> 2048 17.3 against 14.6), where 600M's layers, the largest 4M
    elements, stay faster (1024 -> 4096 4.8 against 5.5 us): 3.3B greedy B=16 6,990 -> 7,625 tok/s."""
    return (MMA_MIN_ROWS <= m <= MMA_MAX_ROWS and _MMA_COMPILED
            and (m <= 8 or d_in * d_out <= MMA_WIDE_MAX_WEIGHT))


def mma_split(d_in: int, d_out: int) -> int:
    """Warps of a block that share 16 outputs' columns in linear_mma (1, 2, 4 or 8): the fewest that give the
    layer MMA_FILL_WARPS warps, never more than leave each part a chunk of 32 columns. A warp's time is its
    chain of batches, so more parts are faster as long as the layer has warps to spare."""
    if MMA_KSPLIT is not None:
        return MMA_KSPLIT
    chunks = math.ceil(d_in / MMA_CHUNK)
    fill = _pow2_at_least(math.ceil(MMA_FILL_WARPS / max(math.ceil(d_out / 16), 1)))
    return min(MMA_WARPS, fill, 1 << (max(chunks, 1).bit_length() - 1))


def mma_loads(d_in: int, ksplit: int, blocks: int) -> int:
    """Chunks a batch of linear_mma's loads (4 or 8) for a launch of `blocks` blocks: 8 where a warp's part of the
    columns is over 4 chunks and the launch fits one block an SM, which is what the registers of 8 leave: the
    warp's loads of W are then issued in fewer batches, the first before the programmatic wait."""
    if MMA_LOADS is not None:
        return MMA_LOADS
    part_chunks = math.ceil(math.ceil(d_in / MMA_CHUNK) / ksplit)
    return 8 if part_chunks > 4 and blocks <= _SM_COUNT else 4


def _own_kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the layout suits gemv.cu and linear_mma.cu: 16-bit data, 16-byte aligned rows, unit column strides."""
    return (x.dtype in (torch.bfloat16, torch.float16) and x.shape[1] % 8 == 0 and vec8(x)
            and weight.stride(1) == 1 and weight.stride(0) % 8 == 0 and vec8(weight))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False) -> torch.Tensor:
    """Semantics: y = x @ weight.T + bias, then ReLU when `relu`. Of 16-bit data, 4 to 16 rows take linear_mma
    (mma_takes: to 8 rows where the weight is large) and fewer the linear_rows kernels (gemv_takes): either is
    then a read of W made once for all rows. More rows take the Triton tiles where `linear_triton.tile` does
    (600M's projections but fc2 at 17-512 rows), else cuBLAS (ReLU in its epilogue where there is a bias, else in
    place after), as does fp32.
    Shape: x [M, I]
    Shape: weight [O, I] (any row stride, unit column stride)
    Shape: bias [O] or None
    Shape: out [M, O]"""
    m, d_in = x.shape
    mma = mma_takes(m, d_in, weight.shape[0])
    gemv = m >= 1 and gemv_takes(m, d_in) and not mma
    if not ((gemv or mma) and _own_kernel_takes(x, weight)):
        y = linear_triton.linear(x, weight, bias, relu)  # programmatic launch, where its tiles beat cuBLAS's
        if y is not None:
            return y
        if relu and bias is not None:  # ReLU in cuBLASLt's epilogue (no second pass over y)
            return torch._addmm_activation(bias, x, weight.t())
        y = torch.nn.functional.linear(x, weight, bias)
        return torch.relu_(y) if relu else y
    sfx = dtype_suffix("x", x)
    need_like("weight", weight, x, "x")
    if weight.dim() != 2 or weight.shape[1] != d_in:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected [O, {d_in}]")
    d_out = weight.shape[0]
    if bias is not None:
        need_same("bias", bias, x, "x", (d_out,))
    y = torch.empty(m, d_out, dtype=x.dtype, device=x.device)
    if gemv:
        ksplit = gemv_split(d_in, d_out)
        name = f"linear_rows{next(b for b in GEMV_ROW_BOUNDS if b >= m)}_{sfx}"
        grid, warps = (math.ceil(d_out / (GEMV_WARPS // ksplit * GEMV_OUT_PER_WARP)),), GEMV_WARPS
    else:
        ksplit = mma_split(d_in, d_out)
        grid, warps = (math.ceil(d_out / (MMA_WARPS // ksplit * 16)),), MMA_WARPS
        tiles = next(t for t in MMA_ROW_TILES if 8 * t >= m)
        name = f"linear_mma{tiles}_l{mma_loads(d_in, ksplit, grid[0])}_{sfx}"
    launch(name, grid, (warps * 32,),
           (ptr(x), i64(x.stride(0)), ptr(weight), i64(weight.stride(0)), ptr(bias), ptr(y), i32(m), i32(d_in),
            i32(d_out), i32(int(relu)), i32(ksplit)))
    return y
