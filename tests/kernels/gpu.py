"""Shared helpers of the GPU kernel tests (tests/kernels/test_ops*.py and the others here): the CUDA ops, or the
reason they are missing, and inputs drawn on the device. Every kernel is compared with its PyTorch reference
on fresh random inputs (one row, odd sizes, a full table, mixed lengths, bf16 and fp32). Outputs are
allocated from poisoned (NaN-filled) memory, so an element the kernel forgot to write fails the finiteness
check. Timings are a bench mode: python3 -m bench.kernels.
"""
from __future__ import annotations

import pytest
import torch

try:
    from kernels import ops, ops_lora, ops_selection
    OPS_ERROR: Exception | None = None
except Exception as exc:  # noqa: BLE001 - reported by test_ops_import on a GPU machine
    ops, ops_lora, ops_selection, OPS_ERROR = None, None, None, exc

needs_ops = pytest.mark.skipif(ops is None, reason=f"kernels.ops unavailable: {OPS_ERROR}")

DTYPES = [torch.bfloat16, torch.float32]
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5, torch.float16: 2e-3}
DEV = "cuda"

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

def logits_inputs(n, V, dtype, g):
    x = randn(n, V, dtype=torch.float32, g=g, scale=3.0)
    x[:, ::97] = float("-inf")  # banned tokens (processors) are -inf
    return x.to(dtype)


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


