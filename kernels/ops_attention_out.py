"""A few rows' attention and its output projection in one launch (kernels/cuda/attention_out.cu), which
kernels/ops.py's decode_attention and cross_attention take for `out_proj` where it applies (`takes`).

One sentence's decode step is a chain of dependent launches, each link ~2-4 us on the H200 whatever its work
(docs/performance.md, "Where the time goes now"): the projection's GEMV after each attention is a link of its
own, 24 a step of 600M. Here every block of an attention item computes that item's output and its share of the
projection, and the LayerNorm that reads the projection adds the heads' shares (PartialSums), so the GEMV's link
goes.
"""
from __future__ import annotations

import math

import torch

from kernels.checks import vec8
from kernels.loader import f32, i32, i64, launch, ptr
from kernels.partial_sums import PartialSums

ATTN_OUT_MAX_ROWS = 4  # each row's blocks read all of W: past a few rows, the GEMM after the attention reads it once
ATTN_OUT_FEATURES = 128  # attention_out.cu: the outputs one block projects
HEAD_SIZES = (64, 128)  # attention_out.cu's kernels (attn_out64_*, attn_append_out128_*, ...)


def takes(n: int, heads: int, head_size: int, wpi: int, q: torch.Tensor, weight: torch.Tensor,
          bias: torch.Tensor | None) -> bool:
    """Whether attention_out.cu runs an attention of n rows planned with `wpi` warps an item with its projection
    (weight [d, d], bias [d] or None, d = heads * head_size): few rows and four warps an item (the plan of a
    sentence's rows), a head size with its kernels, whole chunks of outputs, the weight in q's dtype with 16-byte
    rows. The kernel does not split an item's keys where the plan would (a capacity of 256 keys of heads of 128):
    its blocks are the items times the chunks of outputs, which fill the GPU where the splits were to."""
    d = heads * head_size
    return (1 <= n <= ATTN_OUT_MAX_ROWS and wpi == 4 and head_size in HEAD_SIZES
            and d % ATTN_OUT_FEATURES == 0
            and weight.dtype == q.dtype and weight.device == q.device and tuple(weight.shape) == (d, d)
            and weight.stride(1) == 1 and vec8(weight)
            and (bias is None or (bias.dtype == q.dtype and tuple(bias.shape) == (d,) and bias.stride(0) == 1)))


def launch_attention_out(sfx: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_strides: tuple[int, int, int],
                         index: torch.Tensor, lengths: torch.Tensor, history: torch.Tensor | None,
                         new_kv: tuple[torch.Tensor, torch.Tensor] | None, scale: float,
                         weight: torch.Tensor, bias: torch.Tensor | None) -> PartialSums:
    """The attention of q's rows (as kernels/ops.py's _attention states it: kv_strides = (row, head, key)
    strides of k and v; with new_kv the step's own keys appended) projected by weight and bias, where `takes`:
    each head's share of the projection, which add_layer_norm adds up.
    Shape: q [N, H, D]; out parts [H, N, H*D] float32"""
    n, H, D = q.shape
    part = torch.empty(H, n, H * D, dtype=torch.float32, device=q.device)
    kernel = f"attn_{'append_' if new_kv is not None else ''}out{D}_{sfx}"
    new_args = (ptr(None), ptr(None), i64(0), i64(0)) if new_kv is None else (
        ptr(new_kv[0]), ptr(new_kv[1]), i64(new_kv[0].stride(0)), i64(new_kv[0].stride(1)))
    launch(kernel, (n * H, H * D // ATTN_OUT_FEATURES), (128,),
           (ptr(q), i64(q.stride(0)), i64(q.stride(1)), ptr(k), ptr(v), *(i64(s) for s in kv_strides),
            ptr(index), ptr(lengths), ptr(history), i64(history.stride(0) if history is not None else 0),
            *new_args, i32(n), i32(H), f32(scale * math.log2(math.e)), ptr(weight), i64(weight.stride(0)),
            ptr(part)))
    return PartialSums(part, bias)
