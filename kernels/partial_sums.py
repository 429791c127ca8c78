"""A projection handed to add_layer_norm as fp32 shares of its inputs (kernels/ops_attention_out.py: each head's
share of an attention's output projection, made in the attention's launch): the shares added in order, the bias
added and the whole rounded once where the LayerNorm reads them, as a GEMM's bias epilogue rounds."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PartialSums:
    """y = round(parts[0] + ... + parts[P - 1] + bias), summed in that order in fp32.
    Shape: parts [P, M, O] float32 (contiguous)
    Shape: bias [O] or None"""

    parts: torch.Tensor
    bias: torch.Tensor | None

    def total(self, dtype: torch.dtype) -> torch.Tensor:
        """y, rounded to `dtype`, summed in the kernel's order. Shape: out [M, O]."""
        y = self.parts[0].clone()
        for part in self.parts[1:]:
            y += part
        if self.bias is not None:
            y += self.bias.float()
        return y.to(dtype)
