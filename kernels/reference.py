"""PyTorch reference of every kernel: the CPU path and the oracle for the CUDA kernels.

Each function has the same signature as its CUDA wrapper in `kernels/ops.py`. Shapes use one
legend: N tokens (packed rows of this call), R slot-table rows, T target capacity per row,
P source-pool tokens, H heads, D head dim, d model dim, V vocab, L layers.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kernels.site_lora import SiteLora  # noqa: F401  (ops API: the LoRA argument)
from kernels.reference_selection import (apply_processors, beam_candidates, beam_step,  # noqa: F401  (ops API)
                                         gather_rows, greedy_select, sample_draw, sampling_warp, topk_logprobs)

log = logging.getLogger("engine")


def embed(ids: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
          pos_table: torch.Tensor, scale: float) -> torch.Tensor:
    """Semantics: out[n] = table[ids[n]] * scale + pos_table[positions[n]].
    Shape: ids [N] int64; positions [N] int64; table [V, d]; pos_table [P_max, d]; out [N, d]."""
    return table[ids] * scale + pos_table[positions]


def add_layer_norm(residual: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float, *, delta: SiteLora | None = None, shrink: SiteLora | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: h = residual + x (x None: h = residual); returns (h, LayerNorm(h)). With delta (stacks Bt): x
    is a projection's output with its LoRA h after it, and what is added is _lora_expand's y (x is not written).
    With shrink (stacks A): normed continues with the LoRA h of the projection that reads it, for the GEMM over
    [weight | every slot's B]: columns d + s*R + r hold A[s, 0, r] . normed for the row's slot s and
    r < shrink.ranks[s], zero elsewhere.
    Shape: residual [N, d]; x [N, d] or None, with delta [N, d + S*R]; weight, bias [d]; delta: Bt [S, 1, R, d],
    idx [N] int64, ranks [S] int32; shrink: A [S, 1, R, d], idx [N] int64, ranks [S] int32; h [N, d];
    normed [N, d], with shrink [N, d + S*R]."""
    if delta is not None:
        x = _lora_expand(x.clone(), delta.stacks, delta.idx, delta.ranks)
    h = residual if x is None else residual + x
    normed = F.layer_norm(h, (h.shape[-1],), weight, bias, eps)
    if shrink is None:
        return h, normed
    A, a_idx, a_ranks = shrink.stacks, shrink.idx, shrink.ranks
    slots, _, rank_max, _ = A.shape
    h_next = normed.new_zeros(normed.shape[0], slots, rank_max)
    for slot in a_idx.unique().tolist():  # host reads: this is the CPU path (and the GPU oracle)
        rank = int(a_ranks[slot]) if 0 < slot < slots else 0
        if rank:
            rows = (a_idx == slot).nonzero().squeeze(1)
            h_next[rows, slot, :rank] = normed[rows] @ A[slot, 0, :rank].T
    return h, torch.cat([normed, h_next.flatten(1)], dim=1)


# On the CPU, float32 products go to oneDNN's JIT GEMM (the op torch.compile's CPU fusion calls), which uses the
# CPU's widest vectors where torch's default, MKL, runs a slower path on some CPUs: on the 2-core AMD CPU machine
# the 600M LM head at 8 rows 120 -> 65 ms, fc1 3.2 -> 0.8 ms, a 2048-token prefill's q|k|v 83 -> 68 ms. Below
# ONEDNN_MIN_WEIGHT elements its ~10 us more a call than MKL outweighs the product (the toy model's layers).
ONEDNN_MIN_WEIGHT = 1 << 18
# Without oneDNN, MKL takes a few rows against a wide weight far faster as weight @ x.T than as x @ weight.T (the
# LM head at 8 rows: 167 against 527 ms); from ~100 rows on the two meet.
CPU_FEW_ROWS = 64
_onednn = {"usable": torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool = False) -> torch.Tensor:
    """Semantics: y = x @ weight.T + bias, then ReLU when `relu` (a torch Linear, activation fused).
    Shape: x [M, I]; weight [O, I]; bias [O] or None; out [M, O]."""
    if x.device.type != "cpu" or x.dim() != 2:
        y = F.linear(x, weight, bias)
    elif (_onednn["usable"] and x.dtype == weight.dtype == torch.float32 and weight.numel() >= ONEDNN_MIN_WEIGHT
          and weight.is_contiguous() and x.shape[0] > 0):
        try:
            return _onednn_linear(x.contiguous(), weight, bias, relu)
        except RuntimeError as e:  # degrade, don't die: MKL from here on
            _onednn["usable"] = False
            log.warning("oneDNN linear failed (%s); the CPU's linear layers use MKL from now on", e)
            return linear(x, weight, bias, relu)
    elif x.shape[0] <= CPU_FEW_ROWS:
        y = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias[:, None], weight, x.t())
        y = y.t().contiguous()
    else:
        y = F.linear(x, weight, bias)
    return torch.relu_(y) if relu else y


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "relu" if relu else "none", [], "")


def kv_append(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
              positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Semantics: k_cache[rows[n], :, positions[n]] = k[n] (same for v), in place.
    Shape: k_cache, v_cache [R, H, T, D]; rows, positions [N] int64; k, v [N, H, D]."""
    k_cache[rows, :, positions] = k.to(k_cache.dtype)
    v_cache[rows, :, positions] = v.to(v_cache.dtype)


def kv_append_lora(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                   qkv_ext: torch.Tensor, delta: SiteLora) -> torch.Tensor:
    """Semantics: the decoder step's q|k|v projection with its LoRA delta (_lora_expand of qkv_ext, in place),
    then kv_append of its k and v; returns q|k|v (a view of qkv_ext).
    Shape: k_cache, v_cache [R, H, T, D]; rows, positions [N] int64; qkv_ext [N, 3*H*D + 3*S*R];
    delta: Bt [S, 3, R, H*D], idx [N] int64, ranks [S] int32; out [N, 3*H*D]."""
    _, H, _, D = k_cache.shape
    qkv = _lora_expand(qkv_ext, delta.stacks, delta.idx, delta.ranks)
    _, k, v = (t.reshape(-1, H, D) for t in qkv.split(H * D, dim=-1))
    kv_append(k_cache, v_cache, rows, positions, k, v)
    return qkv


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rows: torch.Tensor, lengths: torch.Tensor, scale: float,
                     *, history: torch.Tensor | None = None,
                     new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                     max_len: int | None = None) -> torch.Tensor:
    """Semantics: with new_kv = (k, v), first kv_append(k_cache, v_cache, rows, lengths - 1, k, v); then for
    each n, softmax(q[n] . K_n[:lengths[n]] * scale) @ V_n, where position t of K_n is
    k_cache[history[rows[n], t], :, t] (beam cache indirection: a beam reads the keys its ancestors wrote, no
    copies); history None: k_cache[rows[n], :, t]. `max_len`: an upper bound of lengths known to the caller
    (the CUDA kernel plans its split with it; here unused: the keys gathered are the longest row's, read from
    lengths, which a bound of a whole graph's rows would only lengthen).
    Shape: q [N, H, D]; k_cache, v_cache [R, H, T, D]; rows, lengths [N] int64;
    history [R, T] int32 or None; new_kv: k, v [N, H, D] or None; out [N, H, D]."""
    if new_kv is not None:
        kv_append(k_cache, v_cache, rows, lengths - 1, *new_kv)
    t_max = int(lengths.max())
    positions = torch.arange(t_max, device=q.device)
    if history is None:  # a row's own keys: a gather of whole rows, far cheaper than one by position
        k = k_cache[:, :, :t_max].index_select(0, rows).transpose(1, 2)  # [N, t, H, D]
        v = v_cache[:, :, :t_max].index_select(0, rows).transpose(1, 2)
    else:
        owners = history[rows, :t_max].long()  # [N, t]
        k, v = k_cache[owners, :, positions], v_cache[owners, :, positions]
    valid = positions[None, :] < lengths[:, None]  # [N, t]
    return _attend_one_query(q, k, v, valid, scale)


def cross_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    starts: torch.Tensor, lengths: torch.Tensor, scale: float,
                    *, max_len: int | None = None, group: int = 1) -> torch.Tensor:
    """Semantics: row n attends the source tokens k_pool[starts[n] : starts[n] + lengths[n]];
    beams of one segment share the same range (no copies). `max_len`: an upper bound of
    lengths known to the caller (the CUDA kernel plans with it; here it only saves a read). `group`: runs of
    that many consecutive rows share one range (the CUDA kernel loads a run's keys once; here nothing changes).
    Shape: q [N, H, D]; k_pool, v_pool [P, H, D]; starts, lengths [N] int64; out [N, H, D]."""
    s_max = max_len if max_len is not None else int(lengths.max())
    index = starts[:, None] + torch.arange(s_max, device=q.device)[None, :]  # [N, s]
    valid = index < (starts + lengths)[:, None]
    index = torch.where(valid, index, starts[:, None]).flatten()
    k = k_pool.index_select(0, index).unflatten(0, valid.shape)  # [N, s, H, D]
    v = v_pool.index_select(0, index).unflatten(0, valid.shape)
    return _attend_one_query(q, k, v, valid, scale)


def _attend_one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """softmax(q . k * scale) @ v over the valid keys, in fp32. A product and a sum, not a batched matmul: with one
    query a head, a matmul's per-batch setup costs the CPU several times the arithmetic.
    Shape: q [N, H, D]; k, v [N, t, H, D]; valid [N, t] bool; out [N, H, D]."""
    k, v = k.transpose(1, 2).float(), v.transpose(1, 2).float()  # [N, H, t, D]: the softmax runs over the last dim
    scores = (q.float()[:, :, None] * k).sum(-1) * scale  # [N, H, t]
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(-1)
    return (probs[..., None] * v).sum(2).to(q.dtype)


# A chunk of sequences is padded to its longest and attended in one batched product; it holds at most this many
# query-key scores a head, so one long source among short ones pads only the few near its length.
ENCODER_CHUNK_SCORES = 1 << 20


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens: list[int] | torch.Tensor, scale: float, max_len: int | None = None) -> torch.Tensor:
    """Semantics: bidirectional attention within each packed sequence
    [cu_seqlens[b], cu_seqlens[b + 1]); no attention across sequences. `max_len` (a bound on the
    lengths) only plans the CUDA kernel's work; this reference ignores it.
    Shape: q, k, v [N, H, D]; cu_seqlens B + 1 offsets (host ints or an int64 tensor); out [N, H, D]."""
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    out = torch.empty_like(q)
    spans = sorted((end - start, start) for start, end in zip(cu[:-1], cu[1:]) if end > start)
    first = 0
    while first < len(spans):  # chunks of sequences of similar length, shortest first
        last = first + 1
        while last < len(spans) and (last + 1 - first) * spans[last][0] ** 2 <= ENCODER_CHUNK_SCORES:
            last += 1
        lengths, starts = torch.tensor(spans[first:last], device=q.device).unbind(1)  # [b]
        positions = torch.arange(spans[last - 1][0], device=q.device)
        valid = positions[None, :] < lengths[:, None]  # [b, s]
        index = torch.where(valid, starts[:, None] + positions, starts[:, None])  # padding reads a real token
        qs, ks, vs = (t.index_select(0, index.flatten()).unflatten(0, index.shape).transpose(1, 2).float()
                      for t in (q, k, v))  # [b, H, s, D]
        attended = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=valid[:, None, None, :], scale=scale)
        out[index[valid]] = attended.transpose(1, 2)[valid].to(q.dtype)
        first = last
    return out


def lora_apply(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor,
               idx: torch.Tensor, ranks: torch.Tensor, tiles: torch.Tensor) -> None:
    """Semantics: gathered LoRA, in place: for each token n with adapter slot s = idx[n] > 0 and each
    part p, y[n, p*O:(p+1)*O] += Bt[s, p, :r].T @ (A[s, p, :r] @ x[n]) with r = ranks[s] (scaling is
    folded into Bt; slot 0 is the base model and is never read). `tiles` (lora_tiles) only schedules
    the CUDA kernel's work; this reference reads idx instead.
    Shape: y [N, P*O]; x [N, I]; A [S, P, R, I]; Bt [S, P, R, O]; idx [N] int64; ranks [S] int32;
    tiles [N // LORA_TILE + S, 32] int32."""
    parts, out = Bt.shape[1], Bt.shape[3]
    for slot in idx.unique().tolist():  # host reads: this is the CPU path (and the GPU oracle)
        rank = int(ranks[slot])
        if slot == 0 or rank == 0:
            continue
        rows = (idx == slot).nonzero().squeeze(1)
        xs = x[rows].to(A.dtype)
        for p in range(parts):
            delta = (xs @ A[slot, p, :rank].T) @ Bt[slot, p, :rank]  # [n, O]
            y[rows, p * out:(p + 1) * out] += delta.to(y.dtype)


def _lora_expand(y_ext: torch.Tensor, Bt: torch.Tensor, idx: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """The LoRA delta of add_layer_norm's and kv_append_lora's `delta`, after one GEMM over a projection's
    weight stacked on every slot's A: y_ext [N, P*O + S*P*R] holds y = y_ext[:, :P*O], then
    h[n, (s*P + p)*R + r] = A[s, p, r] . x[n]. In place: y[n, p*O:(p+1)*O] += h[n, s, p, :r] @ Bt[s, p, :r] for
    s = idx[n] > 0, r = ranks[s]; returns y (a view of y_ext).
    Shape: y_ext [N, P*O + P*S*R]; Bt [S, P, R, O]; idx [N] int64; ranks [S] int32; out [N, P*O]."""
    slots, parts, rank_max, out = Bt.shape
    y = y_ext[:, :parts * out]
    h = y_ext[:, parts * out:].reshape(-1, slots, parts, rank_max)
    for slot in idx.unique().tolist():  # host reads: this is the CPU path (and the GPU oracle)
        rank = int(ranks[slot])
        if slot == 0 or rank == 0:
            continue
        rows = (idx == slot).nonzero().squeeze(1)
        for p in range(parts):
            delta = h[rows, slot, p, :rank] @ Bt[slot, p, :rank]  # [n, O]
            y[rows, p * out:(p + 1) * out] += delta.to(y.dtype)
    return y


LORA_TILE, LORA_RECORD = 16, 32  # rows per tile, ints per tile record (kernels/cuda/lora.cu)


def lora_tiles(idx: torch.Tensor, slots: int) -> torch.Tensor:
    """Semantics: the adapted rows (slot 1..slots-1) grouped into tiles of at most LORA_TILE rows of one
    slot, slots ascending, rows ascending within a slot; record [row0..row15, slot, count, 0...], unused
    records and row entries zero. Built once per forward pass and shared by every lora_apply of it.
    Shape: idx [N] int64; out [N // LORA_TILE + slots, 32] int32."""
    tiles = torch.zeros(idx.numel() // LORA_TILE + slots, LORA_RECORD, dtype=torch.int32, device=idx.device)
    adapted = ((idx > 0) & (idx < slots)).nonzero().squeeze(1)
    slot = idx[adapted]
    order = torch.argsort(slot, stable=True)
    rows, slot = adapted[order], slot[order]
    counts = torch.bincount(slot, minlength=slots)
    per_slot = (counts + LORA_TILE - 1) // LORA_TILE
    first_tile = torch.cumsum(per_slot, 0) - per_slot
    pos = torch.arange(rows.numel(), device=idx.device) - (torch.cumsum(counts, 0) - counts)[slot]
    tile = first_tile[slot] + pos // LORA_TILE
    tiles[tile, pos % LORA_TILE] = rows.int()
    tiles[tile, LORA_TILE] = slot.int()
    tiles[tile, LORA_TILE + 1] = torch.clamp(counts[slot] - (pos // LORA_TILE) * LORA_TILE, max=LORA_TILE).int()
    return tiles
