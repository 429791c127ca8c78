"""The Triton tiles of kernels/linear_triton.py against cuBLAS through torch (what HF's layers call): the same bits
on every shape and row count they take, and cuBLAS in their place, logged once, when a launch fails. GPU only."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.kernels.gpu import gen, needs_ops, ops, poison_allocator, randn

pytestmark = pytest.mark.gpu


def cublas(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, relu: bool) -> torch.Tensor:
    return torch._addmm_activation(b, x, w.t()) if relu else torch.nn.functional.linear(x, w, b)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [17, 32, 33, 64, 100, 128, 129, 200, 256, 300, 512])
@pytest.mark.parametrize("d_out", [1024, 3072, 4096])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("row_stride", [False, True])
def test_triton_tiles_give_the_bits_of_cublas(dtype, m, d_out, relu, row_stride):
    """Odd row counts (a partial row tile), both tile shapes, ReLU, and x and W as column slices of wider
    tensors (the LoRA registry's weights): y equal to cuBLAS's bias epilogue, bit for bit."""
    from kernels import linear_triton
    if linear_triton.triton is None:
        pytest.skip("this torch has no Triton")
    g = gen(m * 7 + d_out)
    wide = 1024 + 8 * row_stride
    x = randn(m, wide, dtype=dtype, g=g)[:, :1024]
    w = randn(d_out, wide, dtype=dtype, g=g, scale=1024 ** -0.5)[:, :1024]
    b = randn(d_out, dtype=dtype, g=g)
    poison_allocator()
    taken = linear_triton.tile(m, 1024, d_out) is not None and linear_triton._HOPPER
    y = linear_triton.linear(x, w, b, relu)
    assert (y is not None) == taken
    if taken:
        assert torch.equal(y, cublas(x, w, b, relu))
        assert torch.equal(ops.linear(x, w, b, relu), y)


@needs_ops
def test_a_failed_triton_launch_leaves_the_product_to_cublas_and_says_so_once(monkeypatch, caplog):
    from kernels import linear_triton
    if linear_triton.triton is None:
        pytest.skip("this torch has no Triton")

    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("no kernel image")

    monkeypatch.setattr(linear_triton, "_linear_kernel", Broken())
    monkeypatch.setattr(linear_triton, "_failed", False)
    g = gen(5)
    x, w, b = randn(64, 1024, dtype=torch.bfloat16, g=g), randn(1024, 1024, dtype=torch.bfloat16, g=g), \
        randn(1024, dtype=torch.bfloat16, g=g)
    with caplog.at_level(logging.WARNING, logger="engine"):
        outs = [ops.linear(x, w, b, False) for _ in range(3)]
    assert all(torch.equal(y, cublas(x, w, b, False)) for y in outs)
    assert sum("Triton linear kernel failed" in r.message for r in caplog.records) == 1
