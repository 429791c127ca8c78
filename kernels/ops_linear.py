"""CUDA kernels for linear layers (kernels/cuda/gemv.cu, and cuBLAS through torch), part of the ops API that
kernels/ops.py exports: same names and signatures as kernels/reference.py, which states the semantics and is the
oracle. The conventions are kernels/ops.py's."""
from __future__ import annotations

import math

import torch

from kernels.checks import dtype_suffix, need_like, need_same, vec8
from kernels.loader import i32, i64, launch, ptr


GEMV_WARPS, GEMV_OUT_PER_WARP, GEMV_SLOT, GEMV_LOADS = 8, 1, 256, 4  # kernels/cuda/gemv.cu
GEMV_ROW_BOUNDS = (1, 2, 4)  # the compiled linear_rows<MR> kernels
GEMV_KSPLIT: int | None = None  # None: gemv_split's choice (bench.kernels sweeps the others)
GEMV_FILL_WARPS = 4096  # warps a one-row layer wants in all (the H200's 132 SMs x 64 warps hold 8,448)


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
    4 rows)."""
    return m <= GEMV_ROW_BOUNDS[-1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False) -> torch.Tensor:
    """Semantics: y = x @ weight.T + bias, then ReLU when `relu`. Up to 4 rows of 16-bit data (gemv_takes) take
    the linear_rows kernels (the layer is then a read of W); more rows, or fp32, take cuBLAS (ReLU in its
    epilogue where there is a bias, else in place after).
    Shape: x [M, I]
    Shape: weight [O, I] (any row stride, unit column stride)
    Shape: bias [O] or None
    Shape: out [M, O]"""
    m, d_in = x.shape
    gemv = (m >= 1 and gemv_takes(m, d_in) and x.dtype in (torch.bfloat16, torch.float16) and d_in % 8 == 0
            and vec8(x) and weight.stride(1) == 1 and weight.stride(0) % 8 == 0 and vec8(weight))
    if not gemv:
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
    bound = next(b for b in GEMV_ROW_BOUNDS if b >= m)
    ksplit = gemv_split(d_in, d_out)
    outputs_per_block = GEMV_WARPS // ksplit * GEMV_OUT_PER_WARP
    launch(f"linear_rows{bound}_{sfx}", (math.ceil(d_out / outputs_per_block),), (GEMV_WARPS * 32,),
           (ptr(x), i64(x.stride(0)), ptr(weight), i64(weight.stride(0)), ptr(bias), ptr(y), i32(m), i32(d_in),
            i32(d_out), i32(int(relu)), i32(ksplit)))
    return y
