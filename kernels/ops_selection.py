"""CUDA kernels for token selection (kernels/cuda/logits.cu, topk.cu, beam.cu, processors.cu, sampling.cu), part of
the ops API that kernels/ops.py exports: same names and signatures as kernels/reference_selection.py, which states the
semantics and is the oracle. The conventions are kernels/ops.py's."""
from __future__ import annotations

import math

import numpy as np
import torch

from kernels import loader
from kernels.checks import dtype_suffix, need_cuda, need_tensor, vec8
from kernels.limits import BEAM_MAX, TOPK_MAX
from kernels.loader import device_properties, f32, i32, i64, launch, ptr
from kernels.reference_selection import EXCLUDED

SEL_THREADS = 256
# topk_logprobs keeps each warp's list in registers up to this k (topk_partial_reg, topk_merge_reg in
# kernels/cuda/topk.cu), in shared memory past it; 0 takes the shared-memory lists everywhere (for A/B timing).
TOPK_REG_MAX = 32
# topk_logprobs' blocks an SM (selection_plan): a top-k block's list, its merge and topk_merge's candidates cost
# more than greedy's, so it splits rows half as far (graph time, k = 8, V = 256,206 bf16: 256 rows 131.5 -> 107.3 us
# at 2 splits a row instead of 3; 16 rows 30.8 -> 28.9; 1,024 and 4 rows take the same plan either way).
TOPK_BLOCKS_PER_SM = 2
# From this many rows an SM a top-k row is not split at all: each split's block fills and merges a list of its
# own, which costs more than the SMs the splits would fill from there (graph time on 132 SMs, k = 8, V = 256,206
# bf16, one split against two: 256 rows 89.0 against 102.7 us, 224 rows 91.3 against 100.2, 198 rows 89.7
# against 81.2, 192 rows 88.0 against 82.8).
TOPK_WHOLE_ROWS_PER_SM = 1.6
_SM_COUNT = device_properties()[0]
_CLUSTERS = loader.sm90()  # thread-block clusters


# ---- token selection ---------------------------------------------------------------------------------
def _logits(name: str, logits: torch.Tensor) -> tuple[str, int, int]:
    sfx = dtype_suffix(name, logits)
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"{name} must be [N, V] with unit stride over V; got shape {tuple(logits.shape)} "
                         f"strides {tuple(logits.stride())}")
    return sfx, logits.shape[0], logits.shape[1]


def selection_plan(n: int, v: int, blocks_per_sm: int = 4) -> tuple[int, int]:
    """(splits per row, chunk) so that small batches still use every SM (`blocks_per_sm` blocks an SM in all; 0
    keeps rows whole); chunks start on 8-element boundaries (the kernels' 16-byte loads)."""
    splits = max(1, min(math.ceil(blocks_per_sm * _SM_COUNT / max(n, 1)), math.ceil(v / 4096)))
    chunk = math.ceil(v / splits / 8) * 8
    return math.ceil(v / chunk), chunk


GATHER_PIECES_PER_BLOCK = 256 * 4  # kernels/cuda/logits.cu: GATHER_THREADS x GATHER_LOADS
GRID_Y_MAX = 65535


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Semantics: out[n] = x[index[n]] (torch.index_select(x, 0, index)). Out keeps x's row stride, so that the
    rows of the LM head's padded logits stay 16-byte aligned for the selection kernels' vector loads; torch's
    index_select of that view makes unaligned contiguous rows, at ~0.9 TB/s (500 rows of V = 256,206 bf16: ~550
    us). Rows that are not 16-byte pieces take index_select.
    Shape: x [R, C] with unit stride over C
    Shape: index [N] int64, each in [0, R)
    Shape: out [N, C]"""
    need_cuda("x", x)
    n = index.numel()
    need_tensor("index", index, torch.int64, (n,))
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [R, C] with unit stride over C; got shape {tuple(x.shape)} strides "
                         f"{tuple(x.stride())}")
    elem, ld = x.element_size(), x.stride(0)
    if (ld * elem) % 16 or x.data_ptr() % 16 or not 0 < n <= GRID_Y_MAX:
        return x.index_select(0, index)
    cols16 = math.ceil(x.shape[1] * elem / 16)  # the last piece may take padding columns within the row stride
    out = torch.empty(n, ld, dtype=x.dtype, device=x.device)
    launch("gather_rows16", (math.ceil(cols16 / GATHER_PIECES_PER_BLOCK), n), (256,),
           (ptr(x), i64(ld * elem // 16), ptr(index), ptr(out), i64(ld * elem // 16), i64(cols16)))
    return out[:, :x.shape[1]]


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
    splits, chunk = selection_plan(n, v, TOPK_BLOCKS_PER_SM if n < TOPK_WHOLE_ROWS_PER_SM * _SM_COUNT else 0)
    part_keys = part_ms = None
    if splits > 1:
        part_keys = torch.empty(n * splits * k, dtype=torch.int64, device=logits.device)
        part_ms = torch.empty(n * splits * 2, dtype=torch.float32, device=logits.device)
    smem = 8 * k * 8
    lists = "_reg" if k <= TOPK_REG_MAX else ""
    launch(f"topk_partial{lists}_{sfx}", (n, splits), (SEL_THREADS,),
           (ptr(logits), i64(logits.stride(0)), i32(v), i32(chunk), i32(vec8(logits)), i32(k), ptr(ban), i64(ban_id),
            ptr(part_keys), ptr(part_ms), ptr(values), ptr(indices)), shared_mem=smem)
    if splits > 1:
        launch(f"topk_merge{lists}", (n,), (SEL_THREADS,),
               (ptr(part_keys), ptr(part_ms), i32(splits), i32(k), ptr(values), ptr(indices)), shared_mem=smem)
    return values, indices


# ---- HF's processors and sampling warpers ------------------------------------------------------------------
PROC_THREADS, WARP_THREADS = 256, 1024  # kernels/cuda/processors.cu, sampling.cu
SAMPLE_CLUSTER, SAMPLE_CL_THREADS = 8, 512  # sampling_warp_cluster: blocks a row, threads a block
# sampling_warp's kernel: None picks the cluster version on sm_90+ (8 blocks share a row: a row at one block's
# bandwidth took ~50 us a pass), False the one-block version (any GPU; for tests and A/B timing)
SAMPLE_CLUSTERS: bool | None = None


def _scores(name: str, scores: torch.Tensor) -> tuple[int, int]:
    need_cuda(name, scores)
    if scores.dtype != torch.float32 or scores.dim() != 2 or scores.stride(1) != 1:
        raise ValueError(f"{name} must be float32 [N, V] with unit stride over V; got {scores.dtype} "
                         f"{tuple(scores.shape)} strides {tuple(scores.stride())}")
    return scores.shape


def apply_processors(scores: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor,
                     penalty: torch.Tensor, ngram: torch.Tensor, ban_eos: torch.Tensor, eos_id: int) -> None:
    """Semantics: HF's history processors in HF's order, in place on row rows[i] of scores, whose decoder
    sequence so far is h = ids[i, :lengths[i]]: the repetition penalty (penalty[i] != 1: each distinct token
    of h, its score x penalty where negative, / penalty otherwise), the no-repeat n-gram ban (ngram[i] = s > 0:
    -inf at every token that would complete an s-gram h already holds), then -inf at eos_id where ban_eos[i]. A
    division by a scalar is torch's on the scores' device (on CUDA: times the float32 reciprocal).
    One block a row.
    Shape: scores [N, V] float32 (unit stride over V)
    Shape: rows [n] int64 (distinct)
    Shape: ids [n, T] int64 (unit stride over T; each row's sequence first, any padding after)
    Shape: lengths, ngram, ban_eos [n] int64
    Shape: penalty [n] float32"""
    _, v = _scores("scores", scores)
    n = rows.shape[0] if rows.dim() == 1 else -1
    need_tensor("rows", rows, torch.int64, (n,))
    need_cuda("ids", ids)
    if ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[0] != n or ids.stride(1) != 1:
        raise ValueError(f"ids must be int64 [{n}, T] with unit stride over T; got {ids.dtype} {tuple(ids.shape)}")
    for name, t in (("lengths", lengths), ("ngram", ngram), ("ban_eos", ban_eos)):
        need_tensor(name, t, torch.int64, (n,))
    need_tensor("penalty", penalty, torch.float32, (n,))
    if n:
        launch("apply_processors", (n,), (PROC_THREADS,),
               (ptr(scores), i64(scores.stride(0)), i32(v), ptr(rows), ptr(ids), i64(ids.stride(0)), ptr(lengths),
                ptr(penalty), ptr(ngram), ptr(ban_eos), i64(eos_id)))


def sampling_warp(scores: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Semantics: HF's sampling warpers in HF's order, per row n: x = scores[n] / temperature[n] (torch's division by a
    scalar on the scores' device: on CUDA, times the float32 reciprocal); top-k (0 < top_k[n] < V: -inf where x <
    its k-th largest value, repeats counted); top-p (top_p[n] < 1: over the softmax of what top-k kept, ascending,
    -inf at every element while the mass at and below it is at most 1 - top_p[n], the largest always kept; the cut
    is exact to ~1e-12). A row holding a NaN is only scaled. A few passes over the row by a cluster of 8 blocks
    (sm_90+) or one block (kernels/cuda/sampling.cu).
    Shape: scores [N, V] float32 (unit stride over V)
    Shape: temperature [N] float32
    Shape: top_k [N] int64
    Shape: top_p [N] float64
    Shape: out [N, V] float32"""
    n, v = _scores("scores", scores)
    need_tensor("temperature", temperature, torch.float32, (n,))
    need_tensor("top_k", top_k, torch.int64, (n,))
    need_tensor("top_p", top_p, torch.float64, (n,))
    out = torch.empty(n, v, dtype=torch.float32, device=scores.device)
    if not n:
        return out
    args = (ptr(scores), i64(scores.stride(0)), i32(v), ptr(temperature), ptr(top_k), ptr(top_p), ptr(out),
            i64(out.stride(0)))
    clusters = SAMPLE_CLUSTERS if SAMPLE_CLUSTERS is not None else _CLUSTERS
    if clusters:
        launch("sampling_warp_cluster", (SAMPLE_CLUSTER, n), (SAMPLE_CL_THREADS,), args)
    else:
        launch("sampling_warp", (1, n), (WARP_THREADS,), args)
    return out


DRAW_THREADS = 1024  # sample_draw: one block a row


def _exponential_threads(v: int, device: torch.device) -> int:
    """The threads torch's CUDA exponential_ runs over V elements (its calc_execution_policy: blocks of 256, at
    most as many as the device keeps resident); which thread draws an element's noise depends on it."""
    props = torch.cuda.get_device_properties(device)
    resident = props.multi_processor_count * (props.max_threads_per_multi_processor // 256)
    return 256 * min(resident, math.ceil(v / 256))


def sample_draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Semantics: kernels/reference_selection.py sample_draw: one token a row as torch.multinomial(probs[n], 1,
    generator=generators[n]) draws it, each generator moved on as that draw moves it. One launch for every row
    (the reference's exponential_ is a launch a row): the kernel makes torch's Philox noise itself, from each
    generator's seed and offset, where probs[n, v] != 0 (kernels/cuda/sampling.cu).
    Shape: probs [N, V] float32 (unit stride over V)
    Shape: generators: N distinct CUDA torch.Generator (each sampled segment has its own; rows sharing one
        would all draw from its offset before the call, where the reference draws them one after another)
    Shape: out [N] int64"""
    n, v = _scores("probs", probs)
    if any(g.device.type != "cuda" for g in generators) or len(generators) != n:
        raise ValueError(f"sample_draw takes one CUDA generator a row: {n} rows, "
                         f"{[str(g.device) for g in generators]}")
    out = torch.empty(n, dtype=torch.int64, device=probs.device)
    if not n:
        return out
    threads = _exponential_threads(v, probs.device)
    step = ((v - 1) // (4 * threads) + 1) * 4  # the Philox offset a draw takes (curand_uniform4 calls x 4)
    offsets = [generator.get_offset() for generator in generators]
    state = np.array([[generator.initial_seed() for generator in generators], offsets], dtype=np.uint64)
    for generator, offset in zip(generators, offsets):
        generator.set_offset(offset + step)
    seeds, offsets = torch.from_numpy(state.view(np.int64)).to(probs.device, non_blocking=True)
    launch("sample_draw", (n,), (DRAW_THREADS,),
           (ptr(probs), i64(probs.stride(0)), i32(v), ptr(seeds), ptr(offsets), i64(threads), ptr(out)))
    return out


# ---- beam search -------------------------------------------------------------------------------------
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
