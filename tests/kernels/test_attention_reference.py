"""The reference encoder attention (kernels/reference.py), which is the CPU path and the CUDA kernel's oracle,
against torch's scaled_dot_product_attention run on each sequence alone. CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import reference as ref


def sdpa_each_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float) -> torch.Tensor:
    out = torch.zeros_like(q)
    for start, end in zip(cu[:-1], cu[1:]):
        if end > start:
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H, S, D]
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1)
    return out


@pytest.mark.parametrize("lengths", [
    [1],
    [7, 3, 12, 1, 5],  # ragged, one chunk
    [2, 300, 4, 9, 300, 1, 64],  # long sources beside short ones: several chunks
    [5, 0, 9, 0, 0],  # empty sequences, as the encoder graph pads its offsets
])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_encoder_attention_keeps_each_sequence_to_itself(lengths, as_tensor):
    g = torch.Generator().manual_seed(sum(lengths))
    H, D = 4, 16
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    q, k, v = (torch.randn(cu[-1], H, D, generator=g) for _ in range(3))
    offsets = torch.tensor(cu) if as_tensor else cu
    got = ref.encoder_attention(q, k, v, offsets, D ** -0.5)
    torch.testing.assert_close(got, sdpa_each_sequence(q, k, v, cu, D ** -0.5), atol=1e-5, rtol=1e-5)


def test_encoder_attention_bounds_each_chunk(monkeypatch):
    """With a small score budget every sequence gets a chunk of its own, and the answer does not change."""
    g = torch.Generator().manual_seed(3)
    cu = [0, 3, 11, 12, 40]
    q, k, v = (torch.randn(cu[-1], 2, 8, generator=g) for _ in range(3))
    whole = ref.encoder_attention(q, k, v, cu, 0.3)
    monkeypatch.setattr(ref, "ENCODER_CHUNK_SCORES", 1)
    torch.testing.assert_close(ref.encoder_attention(q, k, v, cu, 0.3), whole)
    torch.testing.assert_close(whole, sdpa_each_sequence(q, k, v, cu, 0.3), atol=1e-5, rtol=1e-5)
