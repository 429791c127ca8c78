"""PyTorch reference of the token-selection kernels (the CPU path and the oracle for kernels/ops.py).

Same legend as kernels/reference.py: N rows, V vocabulary. Both functions read the logits once in
the CUDA version (kernels/cuda/logits.cu); here they are plain torch.
"""
from __future__ import annotations

import torch


def greedy_select(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: token[n] = argmax_v logits[n, v] (the first index on ties; NaN counts as the largest,
    as in torch.argmax); logprob[n] = log_softmax(logits[n].float())[token[n]].
    Shape: logits [N, V] float32/bfloat16; token [N] int64; logprob [N] float32."""
    x = logits.float()
    token = x.argmax(-1)
    logprob = x.gather(1, token[:, None])[:, 0] - torch.logsumexp(x, -1)
    return token, logprob


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: the k largest entries of log_softmax(logits[n].float()) per row, best first, with
    their vocabulary indices (beam search asks for 2 * num_beams; k <= 128).
    Shape: logits [N, V] float32/bfloat16; values [N, k] float32; indices [N, k] int64."""
    values, indices = torch.topk(torch.log_softmax(logits.float(), -1), k, dim=-1)
    return values, indices
