"""The batch rows' projections of a d_model = 1024 decoder as a Triton tile GEMM launched programmatically, where
cuBLAS's kernels are not: y = x @ W.T + b (then ReLU), fp32 sums over K in order, rounded once after the bias, the
same bits as cuBLAS's bias epilogue on every shape this takes (tests/kernels/test_linear_triton.py).

Why: cuBLAS launches its GEMMs without programmatic launch, so each starts only once the kernel before it has
ended (~1.4 us of a decode step's link), and programmatic edges into them gave other tokens (docs/performance.md,
"CUDA graphs"). This kernel waits inside (griddepcontrol.wait) before it reads x, and lets the next kernel start
right after. A LayerNorm then this GEMM, 12 links in a graph, cold weights, us a link, cuBLAS against this:
1024 -> 1024 at 64 / 128 / 256 / 512 rows 7.13 / 7.52 / 8.02 / 8.14 against 6.47 / 6.61 / 6.72 / 7.15; 1024 ->
3072 at 32 / 128 / 256 rows 7.89 / 8.22 / 9.15 against 6.87 / 7.08 / 8.94. fc2 (4096 -> 1024) and 3.3B's shapes
stay on cuBLAS, whose kernels won there (`tile`).

GPU only, and Hopper only (sm_90, where the tiles were timed against cuBLAS and matched its bits; other GPUs'
cuBLAS picks other kernels). Triton comes with torch's CUDA builds. Where it is missing or a launch fails,
`linear` returns None and the caller runs cuBLAS (logged once)."""
from __future__ import annotations

import logging

import torch

from kernels.loader import programmatic

log = logging.getLogger("engine")

try:
    import triton
    import triton.language as tl
except ImportError:  # a torch without Triton: cuBLAS takes every product
    triton = None

ENABLED = True  # False: cuBLAS everywhere (A/B timing)
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
D_IN = 1024  # the input width these tiles were measured at (600M's and 1.3B's d_model)


def tile(m: int, d_in: int, d_out: int) -> tuple[int, int, int, int] | None:
    """(BM, BN, warps, stages) for m rows of d_in -> d_out, or None: cuBLAS. From the links above: 1024 -> 1024 to
    512 rows; 3072 and 4096 outputs to 256 rows (from 256 rows with wider tiles: 64 x 64 made 256 x 3072 11.3 us)."""
    if d_in != D_IN or not 16 < m <= 512:
        return None
    if d_out == 1024:
        return 64, 64, 4, 4
    if d_out in (3072, 4096) and m <= 256:
        return (64, 64, 4, 4) if m <= 128 else (64, 128, 8, 4)
    return None


if triton is not None:
    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sxm, swn, sym, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, GROUP_M: tl.constexpr, RELU: tl.constexpr, WAIT: tl.constexpr):
        # Tiles in groups of GROUP_M row tiles, so that the blocks running together share W's columns in L2.
        pid = tl.program_id(0)
        n_tiles = tl.cdiv(N, BN)
        group = GROUP_M * n_tiles
        first_m = (pid // group) * GROUP_M
        size_m = min(tl.cdiv(M, BM) - first_m, GROUP_M)
        rm = (first_m + (pid % group) % size_m) * BM + tl.arange(0, BM)
        rn = ((pid % group) // size_m) * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        if WAIT:  # x is the kernel before's output; W and b are constant
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        x_ptrs = x_ptr + rm[:, None] * sxm + rk[None, :]
        w_ptrs = w_ptr + rn[None, :] * swn + rk[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(0, K, BK):
            acc = tl.dot(tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0), tl.load(w_ptrs), acc)
            x_ptrs += BK
            w_ptrs += BK
        y = acc + tl.load(b_ptr + rn)[None, :].to(tl.float32)
        if RELU:
            y = tl.maximum(y, 0.0)
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=rm[:, None] < M)


_failed = False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool) -> torch.Tensor | None:
    """Semantics: ops.linear's (y = x @ weight.T + bias, then ReLU when `relu`) where `tile` takes the shape;
    None where it does not (no bias, fp32, a layout the tiles do not cover, no Triton, not Hopper, or a launch
    failed).
    Shape: x [M, K] (unit column stride)
    Shape: weight [N, K] (unit column stride)
    Shape: bias [N]
    Shape: out [M, N]"""
    global _failed
    m, d_in = x.shape
    plan = tile(m, d_in, weight.shape[0]) if ENABLED and _HOPPER and triton is not None and not _failed else None
    if (plan is None or bias is None or x.dtype not in (torch.bfloat16, torch.float16) or x.stride(1) != 1
            or weight.stride(1) != 1 or weight.dtype != x.dtype or bias.dtype != x.dtype):
        return None
    try:
        return run(x, weight, bias, relu, plan)
    except Exception as e:  # noqa: BLE001 - a compiler or driver failure: cuBLAS from now on
        _failed = True
        log.warning("the Triton linear kernel failed (%s: %s); the batch rows' projections run on cuBLAS",
                    type(e).__name__, e)
        return None


def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, relu: bool,
        plan: tuple[int, int, int, int]) -> torch.Tensor:
    """`linear`'s product with the tile `plan` (BM, BN, warps, stages), whatever `tile` would choose (bench.kernels
    times the tiles it does not take). Needs K a multiple of 128 and N of BN."""
    bm, bn, warps, stages = plan
    m, d_in = x.shape
    d_out = weight.shape[0]
    y = torch.empty(m, d_out, dtype=x.dtype, device=x.device)
    wait = programmatic()
    _linear_kernel[(triton.cdiv(m, bm) * (d_out // bn),)](
        x, weight, bias, y, m, d_out, d_in, x.stride(0), weight.stride(0), y.stride(0), BM=bm, BN=bn, BK=128,
        GROUP_M=8, RELU=relu, WAIT=wait, num_warps=warps, num_stages=stages, launch_pdl=wait)
    return y
