"""The selection kernels of kernels/ops_selection.py (gather_rows, greedy_select, topk_logprobs) against their PyTorch
references: ties, NaN, -inf rows, and the LM head's padded rows read in vectors. GPU only; the beam, sampling
and processor kernels have their own files here."""
from __future__ import annotations

import pytest
import torch

from kernels import reference_selection as ref_sel
from tests.kernels.gpu import DTYPES, SIZES, gen, logits_inputs, needs_ops, ops, poison_allocator

pytestmark = pytest.mark.gpu


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES + [1024])
@pytest.mark.parametrize("V", [1000, 256206])
def test_greedy_select(dtype, n, V):
    g = gen(n * 31 + V)
    x = logits_inputs(n, V, dtype, g)
    poison_allocator()
    token, logprob = ops.greedy_select(x)
    want_token, want_logprob = ref_sel.greedy_select(x)
    xf = x.float()
    first_max = (xf == xf.max(-1, keepdim=True).values).float().argmax(-1)  # ties: the first index
    assert torch.equal(token, first_max)
    assert torch.equal(token, want_token) or dtype == torch.bfloat16  # bf16 may tie; checked above
    assert torch.isfinite(logprob).all()
    torch.testing.assert_close(logprob, want_logprob, atol=1e-4, rtol=1e-5)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 300, 1030])
@pytest.mark.parametrize("V", [1000, 256206, 4099])
def test_gather_rows_copies_rows_as_index_select_and_keeps_the_padded_stride(dtype, n, V):
    """Repeated and out-of-order rows; the LM head's padded view stays padded (its rows aligned for the selection
    kernels' vectors); rows that are not 16-byte pieces (V = 4099 unpadded) take index_select."""
    g = gen(n * 7 + V)
    padded = -(-V // 64) * 64 if V != 4099 else V
    full = logits_inputs(1100, padded, dtype, g)
    x = full[:, :V]
    index = torch.randint(0, 1100, (n,), device=full.device, generator=g)
    index[0] = 1099
    poison_allocator()
    out = ops.gather_rows(x, index)
    assert torch.equal(out, ref_sel.gather_rows(x, index))
    assert out.stride(0) == (padded if (padded * x.element_size()) % 16 == 0 else V)
    if V == 256206:
        assert torch.equal(ops.greedy_select(out)[0], ops.greedy_select(x)[0][index])


@needs_ops
def test_greedy_select_nan():
    x = logits_inputs(3, 5000, torch.float32, gen(37))
    x[1, 4321] = float("nan")
    token, logprob = ops.greedy_select(x)
    want_token, want_logprob = ref_sel.greedy_select(x)
    assert int(token[1]) == int(want_token[1]) == 4321  # NaN ranks highest, as torch.argmax
    assert torch.isnan(logprob[1]) and torch.isnan(want_logprob[1])
    assert torch.isfinite(logprob[[0, 2]]).all()


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_select_edge_rows(dtype):
    """NaN, -inf-only stretches and ties where the vector loop's batch shortcut could miss them (two chunks a
    row at this size): the first NaN wins and makes the log-softmax NaN; ties go to the first index, also inside
    one thread's batch (3, 515 and 2051 share one in the float32 loop, 3 and 2051 in the 16-byte one), whose
    position is found after the pass."""
    x = logits_inputs(8, 5000, dtype, gen(39))
    nan, inf = float("nan"), float("inf")
    x[0, 4321] = nan  # in the second chunk
    x[1, :] = -inf
    x[1, 10] = nan  # among -inf only: nothing summed before it
    x[2, :] = -inf  # argmax 0, log-softmax NaN (as torch)
    x[3, [100, 3000, 4999]] = 50.0  # a tie over batches and chunks
    x[4, [7, 4000]] = nan  # the first of two
    x[5, :4096] = -inf  # a first chunk of -inf, then finite logits
    x[6, [3, 515, 2051]] = 50.0  # a tie inside one batch
    x[7, 2051] = 50.0  # the best in a batch's second half
    token, logprob = ops.greedy_select(x)
    want_token, want_logprob = ref_sel.greedy_select(x)
    assert token.tolist() == [4321, 10, 0, 100, 7, int(want_token[5]), 3, 2051]
    assert torch.equal(torch.isnan(logprob), torch.isnan(want_logprob))
    assert torch.isnan(logprob[[0, 1, 2, 4]]).all()
    torch.testing.assert_close(logprob[[3, 5, 6, 7]], want_logprob[[3, 5, 6, 7]], atol=1e-4, rtol=1e-5)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES + [1024])
@pytest.mark.parametrize("V", [1000, 256206])
@pytest.mark.parametrize("k", [1, 8, 10, 32, 33, 128])  # lists in registers to 32, in shared memory past it
def test_topk_logprobs(dtype, n, V, k):
    g = gen(n * 41 + V + k)
    x = logits_inputs(n, V, dtype, g)
    poison_allocator()
    values, indices = ops.topk_logprobs(x, k)
    want_values, _ = ref_sel.topk_logprobs(x, k)
    assert torch.isfinite(values).all()
    torch.testing.assert_close(values, want_values, atol=1e-4, rtol=1e-5)
    # the indices point at those values, are distinct, and ties come lower index first
    lp = torch.log_softmax(x.float(), -1)
    torch.testing.assert_close(lp.gather(1, indices), want_values, atol=1e-4, rtol=1e-5)
    assert all(len(set(r)) == k for r in indices.tolist())
    tie = values[:, 1:] == values[:, :-1]
    assert bool((indices[:, 1:][tie] > indices[:, :-1][tie]).all())


@needs_ops
def test_topk_logprobs_nan_row():
    x = logits_inputs(3, 5000, torch.float32, gen(43))
    x[1, 17] = float("nan")
    values, indices = ops.topk_logprobs(x, 8)
    want_values, _ = ref_sel.topk_logprobs(x, 8)
    assert torch.isnan(values[1]).all() and torch.isnan(want_values[1]).all()
    torch.testing.assert_close(values[[0, 2]], want_values[[0, 2]], atol=1e-4, rtol=1e-5)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [5000, 4099, 256206])
@pytest.mark.parametrize("k", [8, 32, 128])
def test_topk_logprobs_takes_late_candidates_and_ties_at_the_kth(dtype, V, k):
    """Rows where the kernel's batch skip (a warp passes over a batch whose largest logit cannot beat its k-th key)
    could drop a candidate: rising logits (every batch enters), one value everywhere (only the first k indices),
    the k best at the row's very end, a tie at the k-th key spread over the row, each lane's best at its batch's
    last position, and a NaN after -inf only. The order oracle is a stable descending sort (ties: lower index
    first), the values torch's log-softmax."""
    x = logits_inputs(6, V, dtype, gen(V + k))
    ramp = torch.arange(V, device=x.device, dtype=torch.float32) / V
    x[0] = ramp.to(dtype)
    x[1] = 1.0
    x[2, V - k:] = 20.0 + ramp[:k].to(dtype)
    x[3, torch.arange(5, V, max(1, V // (4 * k)), device=x.device)] = 30.0  # about 4k ties at the k-th key
    x[4] = torch.where(torch.arange(V, device=x.device) % 8 == 7, 40.0 + ramp, x[4].float()).to(dtype)
    x[5] = float("-inf")
    x[5, V - 3] = float("nan")
    values, indices = ops.topk_logprobs(x, k)
    lp = torch.log_softmax(x.float(), -1)
    want = torch.sort(x[:5].float(), dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(indices[:5], want)
    torch.testing.assert_close(values[:5], lp[:5].gather(1, want), atol=1e-4, rtol=1e-5)
    assert torch.isnan(values[5]).all() and int(indices[5, 0]) == V - 3


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 4, 64, 300])
@pytest.mark.parametrize("k", [1, 8, 32])
def test_topk_lists_in_registers_give_the_bits_of_lists_in_shared_memory(monkeypatch, dtype, n, k):
    """The two kinds of warp list keep the same keys, so the kernels' values and indices are the same bits, over
    every plan the row counts take (one block a row; many splits, merged by topk_merge), with a banned token, and
    through rows whose every batch enters the list (rising logits) or where ties decide the k-th place."""
    from kernels import ops_selection  # imports CuPy: only where the GPU tests run
    V = 256206
    x = logits_inputs(n, V, dtype, gen(n * 13 + k))
    x[0] = (torch.arange(V, device=x.device, dtype=torch.float32) / V).to(dtype)
    if n > 1:
        x[1] = 1.0
    ban = (torch.arange(n, device=x.device) % 2).to(torch.int64)
    runs = []
    for reg_max in (32, 0):
        monkeypatch.setattr(ops_selection, "TOPK_REG_MAX", reg_max)
        runs.append(ops.topk_logprobs(x, k, ban, 5))
    (values, indices), (want_values, want_indices) = runs
    assert torch.equal(indices, want_indices)
    assert torch.equal(values, want_values)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 5, 300])
@pytest.mark.parametrize("V", [256206, 1003])
def test_selection_of_padded_rows_reads_them_in_vectors_and_stops_at_v(dtype, n, V):
    """The LM head's logits are a view of rows padded to 8 elements: the kernels read those in 16-byte vectors
    (chunks and the tail short of V included) and must not look past V, where the padding holds a winner."""
    g = gen(53 + n)
    padded = logits_inputs(n, V + 8 - V % 8 + 8, dtype, g)
    padded[:, V:] = 100.0  # past V: must never win
    x = padded[:, :V]
    assert x.stride(0) % 8 == 0
    token, logprob = ops.greedy_select(x)
    want_token, want_logprob = ref_sel.greedy_select(x)
    assert torch.equal(token, want_token)
    torch.testing.assert_close(logprob, want_logprob, atol=1e-4, rtol=1e-5)
    values, indices = ops.topk_logprobs(x, 8)
    want_values, _ = ref_sel.topk_logprobs(x, 8)
    torch.testing.assert_close(values, want_values, atol=1e-4, rtol=1e-5)
    assert (indices < V).all()


