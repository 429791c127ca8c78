"""CUDA kernels for token selection (kernels/cuda/logits.cu, beam.cu), part of the ops API that kernels/ops.py
exports: same names and signatures as kernels/reference_selection.py, which states the semantics and is the
oracle. The conventions are kernels/ops.py's."""
from __future__ import annotations

import math

import torch

from kernels.checks import dtype_suffix, need_cuda, need_tensor, vec8
from kernels.loader import device_properties, f32, i32, i64, launch, ptr
from kernels.reference_selection import EXCLUDED

TOPK_MAX = 128  # kernels/cuda/logits.cu
SEL_THREADS = 256
_SM_COUNT = device_properties()[0]


# ---- token selection ---------------------------------------------------------------------------------
def _logits(name: str, logits: torch.Tensor) -> tuple[str, int, int]:
    sfx = dtype_suffix(name, logits)
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"{name} must be [N, V] with unit stride over V; got shape {tuple(logits.shape)} "
                         f"strides {tuple(logits.stride())}")
    return sfx, logits.shape[0], logits.shape[1]


def selection_plan(n: int, v: int) -> tuple[int, int]:
    """(splits per row, chunk) so that small batches still use every SM; chunks start on 8-element boundaries
    (the kernels' 16-byte loads)."""
    splits = max(1, min(math.ceil(4 * _SM_COUNT / max(n, 1)), math.ceil(v / 4096)))
    chunk = math.ceil(v / splits / 8) * 8
    return math.ceil(v / chunk), chunk


def greedy_select(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: token[n] = argmax_v logits[n, v] (the first index on ties; NaN counts as the largest,
    as in torch.argmax); logprob[n] = log_softmax(logits[n].float())[token[n]]. One pass over V.
    Shape: logits [N, V] float32/bfloat16 (unit stride over V)
    Shape: token [N] int64
    Shape: logprob [N] float32"""
    sfx, n, v = _logits("logits", logits)
    token = torch.empty(n, dtype=torch.int64, device=logits.device)
    logprob = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return token, logprob
    splits, chunk = selection_plan(n, v)
    part_key = part_ms = None
    if splits > 1:
        part_key = torch.empty(n * splits, dtype=torch.int64, device=logits.device)
        part_ms = torch.empty(n * splits * 2, dtype=torch.float32, device=logits.device)
    launch(f"greedy_partial_{sfx}", (n, splits), (SEL_THREADS,),
           (ptr(logits), i64(logits.stride(0)), i32(v), i32(chunk), i32(vec8(logits)), ptr(part_key), ptr(part_ms),
            ptr(token), ptr(logprob)))
    if splits > 1:
        launch("greedy_combine", (math.ceil(n / 8),), (256,),
               (ptr(part_key), ptr(part_ms), i32(n), i32(splits), ptr(token), ptr(logprob)))
    return token, logprob


def topk_logprobs(logits: torch.Tensor, k: int, ban: torch.Tensor | None = None,
                  ban_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: the k largest entries of log_softmax(logits[n].float()) per row, best first (ties: the
    lower index first), with their vocabulary indices (beam search asks for 2 * num_beams; k <= 128);
    rows with ban[n] != 0 never take ban_id, which still counts in the log-softmax.
    Shape: logits [N, V] float32/bfloat16 (unit stride over V)
    Shape: ban [N] int64 or None
    Shape: values [N, k] float32
    Shape: indices [N, k] int64"""
    sfx, n, v = _logits("logits", logits)
    if ban is not None:
        need_tensor("ban", ban, torch.int64, (n,))
    k = int(k)
    if not 1 <= k <= min(TOPK_MAX, v):
        raise ValueError(f"k={k} outside [1, {min(TOPK_MAX, v)}]")
    values = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    indices = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    if n == 0:
        return values, indices
    splits, chunk = selection_plan(n, v)
    part_keys = part_ms = None
    if splits > 1:
        part_keys = torch.empty(n * splits * k, dtype=torch.int64, device=logits.device)
        part_ms = torch.empty(n * splits * 2, dtype=torch.float32, device=logits.device)
    smem = 8 * k * 8
    launch(f"topk_partial_{sfx}", (n, splits), (SEL_THREADS,),
           (ptr(logits), i64(logits.stride(0)), i32(v), i32(chunk), i32(vec8(logits)), i32(k), ptr(ban), i64(ban_id),
            ptr(part_keys), ptr(part_ms), ptr(values), ptr(indices)), shared_mem=smem)
    if splits > 1:
        launch("topk_merge", (n,), (SEL_THREADS,),
               (ptr(part_keys), ptr(part_ms), i32(splits), i32(k), ptr(values), ptr(indices)), shared_mem=smem)
    return values, indices


# ---- beam search -------------------------------------------------------------------------------------
BEAM_MAX = 64  # kernels/cuda/beam.cu's shared arrays; GenerationOptions allows num_beams up to 64


def _beam_rows(rows: torch.Tensor) -> tuple[int, int]:
    need_cuda("rows", rows)
    if rows.dtype != torch.int64 or rows.dim() != 2 or not rows.is_contiguous():
        raise ValueError(f"rows must be contiguous int64 [B, nb]; got {rows.dtype} {tuple(rows.shape)}")
    b, nb = rows.shape
    if not 1 <= nb <= BEAM_MAX:
        raise ValueError(f"{nb} beams; the kernels take 1 to {BEAM_MAX}")
    return b, nb


def beam_candidates(values: torch.Tensor, tokens: torch.Tensor, row_scores: torch.Tensor,
                    rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Semantics: for each of B segments of nb beams, the 2nb best of values[b*nb + i, c] + row_scores[rows[b, i]]
    over its beams i and columns c, best first (NaN the largest; ties: the lower i*k + c first), with the beam
    each comes from and its token tokens[b*nb + i, c].
    Shape: values [B*nb, k] float32 (k >= 2)
    Shape: tokens [B*nb, k] int64
    Shape: row_scores [R] float32
    Shape: rows [B, nb] int64
    Shape: scores [B, 2nb] float32; parents [B, 2nb] int64 (0..nb-1); picked tokens [B, 2nb] int64"""
    b, nb = _beam_rows(rows)
    k = values.shape[-1] if values.dim() == 2 else 0
    if k < 2:
        raise ValueError(f"values must be [B*nb, k >= 2]; got shape {tuple(values.shape)}")
    need_tensor("values", values, torch.float32, (b * nb, k))
    need_tensor("tokens", tokens, torch.int64, (b * nb, k))
    need_tensor("row_scores", row_scores, torch.float32, (row_scores.numel(),))
    scores = torch.empty(b, 2 * nb, dtype=torch.float32, device=values.device)
    parents, picked = (torch.empty(b, 2 * nb, dtype=torch.int64, device=values.device) for _ in range(2))
    if b:
        launch("beam_candidates", (b,), (32,), (ptr(values), ptr(tokens), ptr(row_scores), ptr(rows), i32(nb), i32(k),
                                               ptr(scores), ptr(parents), ptr(picked)))
    return scores, parents, picked


def beam_step(scores: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor,
              lengths: torch.Tensor, at_max: torch.Tensor, eos_id: int, history: torch.Tensor,
              row_scores: torch.Tensor) -> torch.Tensor:
    """Semantics: HF's beam step for B segments of nb beams from their top 2nb candidates (best first), in place
    on history and row_scores; kernels/reference_selection.py states it in full. Returns each beam's token.
    Shape: scores [B, 2nb] float32
    Shape: parents, tokens [B, 2nb] int64
    Shape: rows [B, nb] int64
    Shape: lengths, at_max [B] int64 (positions written so far, each <= T; at_max 0/1)
    Shape: history [R, T] int32 (unit stride over T)
    Shape: row_scores [R] float32
    Shape: out [B*nb] int64, beams in rows order"""
    b, nb = _beam_rows(rows)
    for name, t, dtype in (("scores", scores, torch.float32), ("parents", parents, torch.int64),
                           ("tokens", tokens, torch.int64)):
        need_tensor(name, t, dtype, (b, 2 * nb))
    need_tensor("lengths", lengths, torch.int64, (b,))
    need_tensor("at_max", at_max, torch.int64, (b,))
    need_tensor("row_scores", row_scores, torch.float32, (row_scores.numel(),))
    need_cuda("history", history)
    if history.dtype != torch.int32 or history.dim() != 2 or history.stride(1) != 1:
        raise ValueError(f"history must be int32 [R, T] with unit stride over T; got {history.dtype} "
                         f"{tuple(history.shape)} strides {tuple(history.stride())}")
    out = torch.empty(b * nb, dtype=torch.int64, device=scores.device)
    if b:
        launch("beam_step", (b,), (128,), (ptr(scores), ptr(parents), ptr(tokens), ptr(rows), ptr(lengths),
                                           ptr(at_max), i32(nb), i64(eos_id), f32(EXCLUDED), ptr(history),
                                           i64(history.stride(0)), ptr(row_scores), ptr(out)))
    return out
