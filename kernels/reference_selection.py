"""PyTorch reference of the token-selection kernels (the CPU path and the oracle for kernels/ops.py).

Same legend as kernels/reference.py: N rows, V vocabulary, R slot-table rows, T target capacity, B beam
segments of nb beams. greedy_select and topk_logprobs read the logits once in the CUDA version
(kernels/cuda/logits.cu); beam_candidates and beam_step are one launch each there (kernels/cuda/beam.cu),
so a beam search step costs the host a few launches, not ~30 small torch ops. Here they are plain torch.
"""
from __future__ import annotations

import torch

EXCLUDED = -1.0e9  # HF's "never pick this" score offset (engine/search.py uses this one)


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
