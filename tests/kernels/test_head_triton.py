"""ops.head_greedy (the LM head's product with greedy's selection in its epilogue, kernels/head_triton.py) against
the reference's torch product, argmax and log-sum-exp: the same tokens, log-probs within float32 rounding, on the row
counts and model widths the engine gives it, ties, bans and NaN rows included; and cuBLAS then greedy_select in its
place, logged once, when a launch fails. GPU only."""
from __future__ import annotations

import logging

import pytest
import torch

from engine.weights import padded_head
from kernels import reference
from tests.kernels.gpu import gen, needs_ops, ops, poison_allocator, randn

pytestmark = pytest.mark.gpu

V = 50_021  # not a multiple of the tiles' 256 columns: the last tile is part padding
EOS = 2


def head_of(d: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return padded_head(randn(V, d, dtype=dtype, g=g, scale=d ** -0.5).cpu()).cuda()


def fused_or_skip(x: torch.Tensor, head: torch.Tensor) -> None:
    """Skip where the fused kernel does not take these rows on this GPU; else make sure it ran: a launch that fails
    falls back to cuBLAS, whose tokens these tests would take as the kernel's."""
    from kernels import head_triton
    if head_triton.triton is None or not head_triton._HOPPER:
        pytest.skip("the fused LM head runs on Hopper with Triton only")
    assert head_triton.takes(x, head), "the fused LM head refused rows it should take (or failed before)"
    head_triton.run(x, head, V, None, EOS, head_triton.tile(x.shape[0]))  # raises what a launch raises


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [16, 17, 63, 64, 65, 100, 129, 256, 300, 1024])
@pytest.mark.parametrize("d", [1024, 2048])
@pytest.mark.parametrize("banned", [False, True])
def test_fused_head_picks_the_reference_tokens(dtype, m, d, banned):
    g = gen(m * 3 + d)
    head = head_of(d, dtype, g)
    x = randn(m, d, dtype=dtype, g=g)
    fused_or_skip(x, head)
    ban = (torch.arange(m, device="cuda") % 3 == 0).long() if banned else None
    poison_allocator()
    token, logprob = ops.head_greedy(x, head, V, ban, EOS)
    want_token, want_logprob = reference.head_greedy(x, head, V, ban, EOS)
    assert torch.equal(token, want_token)
    torch.testing.assert_close(logprob, want_logprob, atol=2e-5, rtol=1e-5)


@needs_ops
def test_fused_head_takes_the_first_of_tied_columns_and_skips_a_banned_one():
    """Columns 7 and 40,000 hold the same weights, the largest product of every row: each row takes 7, the
    first; rows that ban 7 (as </s>) take 40,000, whose log-prob leaves 7 out of the sum."""
    g = gen(11)
    d, m = 1024, 64
    head = head_of(d, torch.bfloat16, g)
    u = randn(d, dtype=torch.bfloat16, g=g)
    head[7] = head[40_000] = u * 0.2
    x = (u[None, :] + randn(m, d, dtype=torch.bfloat16, g=g, scale=0.01)).contiguous()
    fused_or_skip(x, head)
    ban = (torch.arange(m, device="cuda") >= m // 2).long()
    token, logprob = ops.head_greedy(x, head, V, ban, 7)
    want_token, want_logprob = reference.head_greedy(x, head, V, ban, 7)
    assert token.tolist() == [7] * (m // 2) + [40_000] * (m // 2)
    assert torch.equal(token, want_token)
    torch.testing.assert_close(logprob, want_logprob, atol=2e-5, rtol=1e-5)


@needs_ops
def test_fused_head_gives_a_nan_row_its_first_nan_as_torch_argmax_does():
    g = gen(12)
    d, m = 1024, 32
    head = head_of(d, torch.bfloat16, g)
    x = randn(m, d, dtype=torch.bfloat16, g=g)
    x[5] = float("nan")
    fused_or_skip(x, head)
    token, logprob = ops.head_greedy(x, head, V)
    want_token, _ = reference.head_greedy(x, head, V)
    assert torch.equal(token, want_token) and token[5] == 0
    assert torch.isnan(logprob[5]) and torch.isfinite(logprob[torch.arange(m, device="cuda") != 5]).all()


@needs_ops
def test_a_failed_fused_head_leaves_greedy_to_cublas_and_greedy_select_and_says_so_once(monkeypatch, caplog):
    from kernels import head_triton
    if head_triton.triton is None:
        pytest.skip("this torch has no Triton")

    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("no kernel image")

    monkeypatch.setattr(head_triton, "_head_greedy_kernel", Broken())
    monkeypatch.setattr(head_triton, "_failed", False)
    g = gen(13)
    head = head_of(1024, torch.bfloat16, g)
    x = randn(64, 1024, dtype=torch.bfloat16, g=g)
    with caplog.at_level(logging.WARNING, logger="engine"):
        outs = [ops.head_greedy(x, head, V) for _ in range(3)]
    want = ops.greedy_select(torch.nn.functional.linear(x, head)[:, :V])
    assert all(torch.equal(token, want[0]) and torch.equal(logprob, want[1]) for token, logprob in outs)
    assert sum("Triton LM head kernel failed" in r.message for r in caplog.records) == 1
