"""PyTorch reference of the token-selection kernels (the CPU path and the oracle for kernels/ops.py).

Same legend as kernels/reference.py: N rows, V vocabulary, R slot-table rows, T target capacity, B beam segments of
nb beams, n the rows a call acts on. greedy_select and topk_logprobs read the logits once in the CUDA version
(kernels/cuda/logits.cu, topk.cu); beam_candidates and beam_step are one launch each there (kernels/cuda/beam.cu), so
a beam search step costs the host a few launches, not ~30 small torch ops; apply_processors and sampling_warp are one
launch each for all rows (kernels/cuda/processors.cu, sampling.cu). Here they are plain torch, HF's own formulas
(transformers' RepetitionPenalty, NoRepeatNGram, Temperature, TopK and TopP processors), a row at a time.
"""
from __future__ import annotations

import torch

EXCLUDED = -1.0e9  # HF's "never pick this" score offset (engine/search.py uses this one)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Semantics: out[n] = x[index[n]]. Shape: x [R, C]; index [N] int64; out [N, C]."""
    return x.index_select(0, index)


def greedy_select(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: token[n] = argmax_v logits[n, v] (the first index on ties; NaN counts as the largest,
    as in torch.argmax); logprob[n] = log_softmax(logits[n].float())[token[n]].
    Shape: logits [N, V] float32/bfloat16; token [N] int64; logprob [N] float32."""
    x = logits.float()
    token = x.argmax(-1)
    logprob = x.gather(1, token[:, None])[:, 0] - torch.logsumexp(x, -1)
    return token, logprob


def topk_logprobs(logits: torch.Tensor, k: int, ban: torch.Tensor | None = None,
                  ban_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: the k largest entries of log_softmax(logits[n].float()) per row, best first, with
    their vocabulary indices (beam search asks for 2 * num_beams; k <= 128); rows with ban[n] != 0
    never take ban_id, which still counts in the log-softmax (HF bans </s> after it).
    Shape: logits [N, V] float32/bfloat16; ban [N] int64 or None; values [N, k] float32; indices [N, k] int64."""
    logprobs = torch.log_softmax(logits.float(), -1)
    if ban is not None:
        logprobs[:, ban_id].masked_fill_(ban.bool(), float("-inf"))
    values, indices = torch.topk(logprobs, k, dim=-1)
    return values, indices


def beam_candidates(values: torch.Tensor, tokens: torch.Tensor, row_scores: torch.Tensor,
                    rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Semantics: for each of B segments of nb beams, the 2nb best of values[b*nb + i, c] + row_scores[rows[b, i]]
    over its beams i and columns c, best first (NaN the largest; ties in either order, the CUDA kernel puts the
    lower i*k + c first), with the beam each comes from and its token tokens[b*nb + i, c].
    Shape: values [B*nb, k] float32 (k >= 2); tokens [B*nb, k] int64; row_scores [R] float32; rows [B, nb] int64
    Shape: scores [B, 2nb] float32; parents [B, 2nb] int64 (0..nb-1); picked tokens [B, 2nb] int64"""
    b, nb = rows.shape
    k = values.shape[1]
    accumulated = (values + row_scores[rows.reshape(-1)][:, None]).view(b, nb * k)
    scores, pos = torch.topk(accumulated, 2 * nb)  # pos: beam * k + column
    return scores, pos // k, tokens.view(b, nb * k).gather(1, pos)


def beam_step(scores: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor,
              lengths: torch.Tensor, at_max: torch.Tensor, eos_id: int, history: torch.Tensor,
              row_scores: torch.Tensor) -> torch.Tensor:
    """Semantics: HF's beam step for B segments of nb beams from their top 2nb candidates (best first): a
    candidate stops when its token is eos_id or the segment is at_max; beam j takes the j-th of the
    candidates ordered unstopped first (stable), its score + EXCLUDED where stopped (a float32 add), written
    to row_scores[rows[b, j]], and its parent's history: history[rows[b, j], :lengths[b]] =
    history[rows[b, parents[b, keep_j]], :lengths[b]] as it was before the step; returns each beam's token.
    Shape: scores [B, 2nb] float32; parents, tokens [B, 2nb] int64; rows [B, nb] int64
    Shape: lengths [B] int64; at_max [B] int64 (0/1); history [R, T] int32; row_scores [R] float32
    Shape: out [B*nb] int64, beams in rows order"""
    nb = rows.shape[1]
    stops = (tokens == eos_id) | at_max.bool()[:, None]
    keep = torch.sort(stops.to(torch.uint8), dim=1, stable=True).indices[:, :nb]  # unstopped first, best first
    kept_tokens, kept_scores = tokens.gather(1, keep), scores.gather(1, keep)
    kept_scores = torch.where(stops.gather(1, keep), kept_scores + EXCLUDED, kept_scores)
    src = rows.gather(1, parents.gather(1, keep)).view(-1)
    dst = rows.reshape(-1)
    written = torch.arange(history.shape[1], device=history.device)[None, :] < lengths.repeat_interleave(nb)[:, None]
    history[dst] = torch.where(written, history[src], history[dst])
    row_scores[dst] = kept_scores.view(-1)
    return kept_tokens.view(-1)


# ---- HF's logits processors and sampling warpers ----------------------------------------------------------
def repetition_penalty(ids: torch.Tensor, scores: torch.Tensor, penalty: float) -> torch.Tensor:
    """Shape: ids [n, t]; scores [n, V]. Seen tokens: negative scores x penalty, positive / penalty."""
    seen = scores.gather(1, ids)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return scores.scatter(1, ids, seen)


def no_repeat_ngram(ids: torch.Tensor, scores: torch.Tensor, n: int) -> torch.Tensor:
    """Ban every token that would complete an n-gram already present in `ids`.
    Shape: ids [r, t]; scores [r, V]."""
    t = ids.shape[1]
    if t < n:
        return scores
    windows = ids.unfold(1, n, 1)  # [r, t - n + 1, n]
    prefix = ids[:, t - n + 1:]  # the last n - 1 tokens
    hits = (windows[..., :-1] == prefix[:, None, :]).all(-1)  # [r, windows]
    banned = torch.zeros(scores.shape[0], scores.shape[1] + 1, dtype=torch.bool, device=scores.device)
    banned.scatter_(1, torch.where(hits, windows[..., -1], scores.shape[1]), True)
    return scores.masked_fill(banned[:, :-1], float("-inf"))


def apply_processors(scores: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor,
                     penalty: torch.Tensor, ngram: torch.Tensor, ban_eos: torch.Tensor, eos_id: int) -> None:
    """Semantics: HF's history processors in HF's order, in place on row rows[i] of scores, whose decoder
    sequence so far is h = ids[i, :lengths[i]]: the repetition penalty (penalty[i] != 1: each distinct token
    of h, its score x penalty where negative, / penalty otherwise), the no-repeat n-gram ban (ngram[i] = s > 0:
    -inf at every token that would complete an s-gram h already holds), then -inf at eos_id where ban_eos[i]
    (min_new_tokens). A division by a scalar is torch's on the scores' device (on CUDA: times the float32
    reciprocal).
    Shape: scores [N, V] float32 (unit stride over V)
    Shape: rows [n] int64 (distinct)
    Shape: ids [n, T] int64 (each row's sequence first, any padding after)
    Shape: lengths, ngram, ban_eos [n] int64
    Shape: penalty [n] float32"""
    for i in range(rows.shape[0]):  # a row at a time: the CPU path's rows are few
        h = ids[i, :int(lengths[i])][None]
        row = scores[int(rows[i])][None]
        if float(penalty[i]) != 1.0:
            row = repetition_penalty(h, row, float(penalty[i]))
        if int(ngram[i]) > 0:
            row = no_repeat_ngram(h, row, int(ngram[i]))
        if int(ban_eos[i]):
            row[:, eos_id] = float("-inf")
        scores[int(rows[i])] = row[0]


def _warp_row(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    scores = scores / temperature
    if torch.isnan(scores).any():
        return scores
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k)[0][..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum <= (1 - top_p)
        drop[..., -1:] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return scores


def sampling_warp(scores: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Semantics: HF's sampling warpers in HF's order, per row n: x = scores[n] / temperature[n] (torch's division by a
    scalar on the scores' device: on CUDA, times the float32 reciprocal); top-k (0 < top_k[n] < V: -inf where x <
    its k-th largest value, repeats counted); top-p (top_p[n] < 1: over the softmax of what top-k kept, ascending,
    -inf at every element while the mass at and below it is at most 1 - top_p[n], the largest always kept). A row
    holding a NaN is only scaled. The CUDA kernel's top-p cut is exact to ~1e-12 where this one's float32 cumsum is
    not: elements whose mass at and below lies within float32 rounding of 1 - top_p may fall either side.
    Shape: scores [N, V] float32; temperature [N] float32; top_k [N] int64; top_p [N] float64
    Shape: out [N, V] float32"""
    rows = [_warp_row(scores[i][None], float(temperature[i]), int(top_k[i]), float(top_p[i]))
            for i in range(scores.shape[0])]
    return torch.cat(rows) if rows else torch.empty_like(scores)


def sample_draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Semantics: one token a row as torch.multinomial(probs[n], 1, generator=generators[n]) draws it (its one-sample
    path): argmax_v probs[n, v] / q[n, v] (the first index on ties, NaN the largest) with q[n] what
    exponential_(1, generator=generators[n]) writes over a [1, V] tensor, so each generator moves on as that draw
    moves it: the same seed draws the same token in any batch, and as HF's sampling does.
    Shape: probs [N, V] float32; generators: N torch.Generator on probs' device
    Shape: out [N] int64"""
    noise = torch.empty_like(probs)
    for i, generator in enumerate(generators):
        noise[i:i + 1].exponential_(1, generator=generator)
    return torch.div(probs, noise, out=noise).argmax(-1)
