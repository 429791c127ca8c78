"""The reference linear (kernels/reference.py), the CPU path's every projection and the LM head, against
torch.nn.functional.linear in float64: oneDNN's product for large weights, MKL's for small ones and as the
fallback when oneDNN fails. CPU."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from kernels import reference as ref


def float64_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool) -> torch.Tensor:
    y = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return (torch.relu(y) if relu else y).float()


@pytest.mark.parametrize("rows", [1, 3, 8, 65, 300])
@pytest.mark.parametrize("shape", [(64, 192), (1024, 512)])  # below and above ONEDNN_MIN_WEIGHT
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("relu", [False, True])
def test_linear_matches_a_float64_product(rows, shape, with_bias, relu):
    g = torch.Generator().manual_seed(rows * 7 + shape[0])
    d_in, d_out = shape
    x = torch.randn(rows, d_in, generator=g)
    weight = torch.randn(d_out, d_in, generator=g) * d_in ** -0.5
    bias = torch.randn(d_out, generator=g) if with_bias else None
    got = ref.linear(x, weight, bias, relu)
    torch.testing.assert_close(got, float64_linear(x, weight, bias, relu), atol=2e-5, rtol=2e-5)


def test_a_failing_onednn_product_falls_back_to_mkl_and_says_so_once(monkeypatch, caplog):
    calls = []

    def failing(*args):
        calls.append(args)
        raise RuntimeError("unsupported")

    monkeypatch.setitem(ref._onednn, "usable", True)
    monkeypatch.setattr(ref, "_onednn_linear", failing)
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 1024, generator=g), torch.randn(512, 1024, generator=g)
    bias = torch.randn(512, generator=g)
    with caplog.at_level(logging.WARNING, logger="engine"):
        first = ref.linear(x, weight, bias, True)
        second = ref.linear(x, weight, bias, True)
    torch.testing.assert_close(first, float64_linear(x, weight, bias, True), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(second, first)
    assert len(calls) == 1
    assert [r.message for r in caplog.records if "oneDNN" in r.message] == [
        "oneDNN linear failed (unsupported); the CPU's linear layers use MKL from now on"]
