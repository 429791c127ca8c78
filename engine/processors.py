"""Logits processors and warpers with HF `generate` semantics, applied in HF's order.

Order (transformers `_get_logits_processor`): repetition penalty, no-repeat n-gram, min new
tokens, forced BOS (the target-language token at decoder length 1); then, when sampling, the
warpers temperature, top-k, top-p. `ids` is always the full decoder sequence so far, decoder
start token included, exactly what HF passes to its processors.
"""
from __future__ import annotations

import torch

from engine.options import GenerationOptions


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


def process(opts: GenerationOptions, ids: torch.Tensor, scores: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Apply the processors (not the warpers) for decoder length t = ids.shape[1] >= 2.
    At t == 1 the forced language token replaces everything: see `forced_scores`."""
    if opts.repetition_penalty != 1.0:
        scores = repetition_penalty(ids, scores, opts.repetition_penalty)
    if opts.no_repeat_ngram_size > 0:
        scores = no_repeat_ngram(ids, scores, opts.no_repeat_ngram_size)
    if ids.shape[1] - 1 < opts.min_new_tokens:  # new tokens so far, the decoder start excluded
        scores = scores.clone()
        scores[:, eos_id] = float("-inf")
    return scores


def forced_scores(rows: int, vocab: int, token: int, device: torch.device) -> torch.Tensor:
    """HF ForcedBOSTokenLogitsProcessor at decoder length 1: -inf everywhere but `token` (0)."""
    scores = torch.full((rows, vocab), float("-inf"), device=device)
    scores[:, token] = 0.0
    return scores


def warp(opts: GenerationOptions, scores: torch.Tensor) -> torch.Tensor:
    """Sampling warpers: temperature, top-k, top-p (min_tokens_to_keep 1). Shape: scores [n, V]."""
    if opts.temperature != 1.0:
        scores = scores / opts.temperature
    if opts.top_k:
        k = min(opts.top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if opts.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum <= (1 - opts.top_p)
        drop[..., -1:] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return scores
