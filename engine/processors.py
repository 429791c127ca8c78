"""HF's logits processors and sampling warpers for a step's rows, batched into one op call each.

Order (transformers `_get_logits_processor`): repetition penalty, no-repeat n-gram, min new tokens (the </s>
ban), forced BOS (the target-language token at decoder length 1); then, when sampling, the warpers
temperature, top-k, top-p. The ops (`apply_processors`, `sampling_warp`: kernels/reference_selection.py
states them) take every row's parameters as tensors, so segments with different options share one launch.
A row's history is the full decoder sequence so far, decoder start token included, exactly what HF passes to
its processors; it is read from the searches on the host and uploaded with the step (no stream sync).
"""
from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from engine.devices import upload


def bans_eos(search) -> bool:
    """Whether </s> is banned at this search's current step: fewer than min_new_tokens are out (cur_len - 1:
    the decoder start is not a new token)."""
    return search.cur_len - 1 < search.ctx.options.min_new_tokens


def acts_on(search) -> bool:
    """Whether the processors change this search's scores at its current step: history processors, or the
    </s> ban."""
    return search.ctx.uses_history or bans_eos(search)


def history_processors(ops: ModuleType, scores: torch.Tensor, members: list, eos_id: int) -> None:
    """HF's processors, in place, on the rows of `members`: (segment, position of its first row in scores),
    each segment's rows in order. Segments past min_new_tokens without history processors may be among them:
    their rows are left as they are.
    Shape: scores [N, V] float32."""
    rows, histories, penalty, ngram, ban_eos = [], [], [], [], []
    for seg, at in members:
        search = seg.search
        opts, bans = search.ctx.options, bans_eos(search)
        for i, history in enumerate(search.histories()):
            rows.append(at + i)
            histories.append(history)
            penalty.append(opts.repetition_penalty)
            ngram.append(opts.no_repeat_ngram_size)
            ban_eos.append(bans)
    if not rows:
        return
    ids = np.zeros((len(rows), max(len(h) for h in histories)), dtype=np.int64)
    for i, history in enumerate(histories):
        ids[i, :len(history)] = history
    ints = upload(np.stack([rows, [len(h) for h in histories], ngram, ban_eos]).astype(np.int64), scores.device)
    ops.apply_processors(scores, ints[0], upload(ids, scores.device), ints[1],
                         upload(np.array(penalty, dtype=np.float32), scores.device), ints[2], ints[3], eos_id)


def sampling_warp(ops: ModuleType, scores: torch.Tensor, segments: list) -> torch.Tensor:
    """HF's warpers (temperature, top-k, top-p) for one row per sampled segment, in segment order.
    Shape: scores [len(segments), V] float32; out the same."""
    options = [seg.search.ctx.options for seg in segments]
    device = scores.device
    return ops.sampling_warp(scores, upload(np.array([o.temperature for o in options], dtype=np.float32), device),
                             upload(np.array([o.top_k for o in options], dtype=np.int64), device),
                             upload(np.array([o.top_p for o in options], dtype=np.float64), device))


def forced_scores(rows: int, vocab: int, token: int, device: torch.device) -> torch.Tensor:
    """HF ForcedBOSTokenLogitsProcessor at decoder length 1: -inf everywhere but `token` (0)."""
    scores = torch.full((rows, vocab), float("-inf"), device=device)
    scores[:, token] = 0.0
    return scores
