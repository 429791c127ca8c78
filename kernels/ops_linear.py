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


def gemv_split(d_in: int) -> int:
    """Warps that share an output's columns (1, 2, 4 or 8): enough that each warp's share fits one batch of
    loads, so a wide layer still spreads over every SM (fc2, 4096 -> 1024: 3.2 us at 4 against 7.4 at 1)."""
    if GEMV_KSPLIT is not None:
        return GEMV_KSPLIT
    batches = math.ceil(d_in / (GEMV_SLOT * GEMV_LOADS))
    return min(GEMV_WARPS, 1 << max(0, batches - 1).bit_length())


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
    ksplit = gemv_split(d_in)
    outputs_per_block = GEMV_WARPS // ksplit * GEMV_OUT_PER_WARP
    launch(f"linear_rows{bound}_{sfx}", (math.ceil(d_out / outputs_per_block),), (GEMV_WARPS * 32,),
           (ptr(x), i64(x.stride(0)), ptr(weight), i64(weight.stride(0)), ptr(bias), ptr(y), i32(m), i32(d_in),
            i32(d_out), i32(int(relu)), i32(ksplit)))
    return y
