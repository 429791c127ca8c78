"""CUDA kernels for the embedding and the residual add + LayerNorm (kernels/cuda/embed_norm.cu), part of the ops API
that kernels/ops.py exports: same names and signatures as kernels/reference.py, which states the semantics and is
the oracle. The conventions are kernels/ops.py's."""
from __future__ import annotations

import math

import torch

from kernels.checks import (dtype_suffix, need_contiguous, need_index, need_like, need_same, need_shape, need_tensor,
                            vec8)
from kernels.limits import LN_MAX_D
from kernels.loader import f32, i32, i64, launch, ptr
from kernels.ops_lora import LORA_MAX_RANK, need_lora_cols
from kernels.site_lora import SiteLora


def embed(ids: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
          pos_table: torch.Tensor, scale: float) -> torch.Tensor:
    """Semantics: out[n] = table[ids[n]] * scale + pos_table[positions[n]] (the product rounded to the
    storage dtype first, as the reference does); ids are not range-checked (the engine validates them).
    Shape: ids [N] int64
    Shape: positions [N] int64
    Shape: table [V, d]
    Shape: pos_table [P_max, d]
    Shape: out [N, d]"""
    sfx = dtype_suffix("table", table)
    need_contiguous("table", table)
    need_like("pos_table", pos_table, table, "table")
    need_contiguous("pos_table", pos_table)
    if pos_table.dim() != 2 or pos_table.shape[1] != table.shape[1]:
        raise ValueError(f"pos_table has shape {tuple(pos_table.shape)}; expected [P_max, {table.shape[1]}]")
    n = ids.numel()
    need_index("ids", ids, n)
    need_index("positions", positions, n)
    d = table.shape[1]
    out = torch.empty(n, d, dtype=table.dtype, device=table.device)
    if n:
        launch(f"embed_{sfx}", (n,), (128,), (ptr(ids), ptr(positions), ptr(table), ptr(pos_table),
                                              f32(scale), ptr(out), i32(d)))
    return out


def add_layer_norm(residual: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float, *, delta: SiteLora | None = None, shrink: SiteLora | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: h = residual + x (x None: h = residual); returns (h, LayerNorm(h)). h is rounded to the
    storage dtype before the statistics (fp32), as the reference computes LayerNorm of the stored h. With
    delta (its stacks Bt): x is a projection's output with its LoRA h after it (one part: [N, d + S*R], the
    GEMM over the weight stacked on every slot's A), and x's first d columns plus each row's delta, rounded, are
    what is added (x is not written). With shrink (its stacks A: the LoRA A of the projection that reads the
    result): each normed row continues with S*R columns, the row's slot's h = A[s, 0, :r] @ normed (the stored
    values, fp32 sums, rounded; r = shrink.ranks[s]) and zeros for every other slot, rank past r and base row,
    so that one GEMM over [weight | every slot's B] adds the delta (engine/lora.py). Delta and shrink share one
    idx (the same tensor: the kernel reads it once).
    Shape: residual [N, d]
    Shape: x [N, d] or None (any row stride, rows 16-byte aligned); with delta [N, d + S*R]
    Shape: weight, bias [d]
    Shape: delta: Bt [S, 1, R, d]; idx [N] int64; ranks [S] int32
    Shape: shrink: A [S, 1, R, d] (contiguous); idx [N] int64; ranks [S] int32
    Shape: h [N, d]; normed [N, d], with shrink [N, d + S*R]"""
    sfx = dtype_suffix("residual", residual)
    need_contiguous("residual", residual)
    if residual.dim() != 2:
        raise ValueError(f"residual has shape {tuple(residual.shape)}; expected [N, d]")
    n, d = residual.shape
    stacks = None  # (S, R) of the LoRA stacks, when either side of the norm has them
    if delta is not None:
        if x is None:
            raise ValueError("add_layer_norm: a LoRA delta needs the x it adds to")
        stacks = need_lora_cols("x", x, delta.stacks, delta.idx, delta.ranks, d)
        if x.shape[0] != n:
            raise ValueError(f"x has {x.shape[0]} rows; residual has {n}")
    elif x is not None:
        need_like("x", x, residual, "residual")
        need_shape("x", x, (n, d))
    if shrink is not None:
        stacks = _need_shrink(shrink, residual, stacks, delta.idx if delta is not None else None)
    for name, t in (("weight", weight), ("bias", bias)):
        need_same(name, t, residual, "residual", (d,))
    if d % 8 or d > LN_MAX_D or not all(vec8(t) for t in (residual, x, weight, bias) if t is not None):
        raise ValueError(f"add_layer_norm needs rows of a multiple of 8 elements up to {LN_MAX_D} (d={d}) on "
                         "16-byte boundaries")
    width = d + (stacks[0] * stacks[1] if shrink is not None else 0)
    normed = residual.new_empty(n, width)
    h = residual if x is None else torch.empty_like(residual)
    if not n:
        return h, normed
    threads = min(256, max(32, math.ceil(d / 8 / 32) * 32))  # a piece of 8 a thread up to d = 2048
    x_args = (ptr(residual), ptr(x), i64(x.stride(0) if x is not None else d))
    out_args = (ptr(weight), ptr(bias), f32(eps), ptr(h), ptr(normed))
    if stacks is None:
        launch(f"add_layer_norm_{sfx}", (n,), (threads,), (*x_args, *out_args, i32(d)))
        return h, normed
    idx = (delta or shrink).idx  # one idx for both (_need_shrink)
    Bt, ranks = (delta.stacks, delta.ranks) if delta is not None else (None, None)
    A, a_ranks = (shrink.stacks, shrink.ranks) if shrink is not None else (None, None)
    launch(f"add_layer_norm_lora_{sfx}", (n,), (threads,),
           (*x_args, ptr(Bt), ptr(idx), ptr(ranks), i32(stacks[0]), i32(stacks[1]),
            ptr(A), ptr(a_ranks), *out_args, i64(width), i32(d)))
    return h, normed


def _need_shrink(shrink: SiteLora, residual: torch.Tensor, stacks: tuple[int, int] | None,
                 delta_idx: torch.Tensor | None) -> tuple[int, int]:
    """Check add_layer_norm's shrink (stacks A) against the rows and the delta's stacks and slots (the kernel
    reads one idx for both); (S, R)."""
    A, idx, a_ranks = shrink.stacks, shrink.idx, shrink.ranks
    if delta_idx is not None and delta_idx is not idx:
        raise ValueError("add_layer_norm: the delta's idx and the shrink's must be the same tensor of row slots")
    n, d = residual.shape
    need_like("A", A, residual, "residual")
    need_contiguous("A", A)
    if A.dim() != 4 or A.shape[1] != 1 or A.shape[3] != d or A.shape[2] % 16 or A.shape[2] > LORA_MAX_RANK:
        raise ValueError(f"A has shape {tuple(A.shape)}; expected [S, 1, R, {d}] with R a multiple of 16 up to "
                         f"{LORA_MAX_RANK}")
    slots, _, rank_max, _ = A.shape
    if stacks is not None and stacks != (slots, rank_max):
        raise ValueError(f"A's stacks (S, R) = {(slots, rank_max)} differ from Bt's {stacks}")
    need_index("idx", idx, n)
    need_tensor("a_ranks", a_ranks, torch.int32, (slots,))
    return slots, rank_max
