"""One HF beam step for the segments of one beam width, taken twice from the same candidates.

On the device, when selection is launched: each row's next token, the cache reorder (a beam takes its
parent's `history`) and the running scores, so that the next decode step can be queued before the host
has read anything. On the host, when it reads the candidates: the same decisions again, for the host
mirror of the next tokens and for each segment's search (its hypotheses and finished set).

The decision, HF's: of a segment's top 2 x nb candidates (best first), those ending in </s> or reaching
max_length stop; the best nb unstopped run on (stopped ones, at -1e9, only as filler); stopped ones among
the top nb are offered to the segment's finished set. Both sides take it from the same float32 scores
and int64 tokens with a stable sort on the stop flags, so they agree exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from engine.devices import upload
from kernels.reference_selection import EXCLUDED


@dataclass
class BeamStepInputs:
    """B segments of one beam width nb at a step: what both sides of the step read (engine/beam_search.py
    BeamRows.step_inputs makes it)."""

    segments: list  # [B]
    rows: np.ndarray  # [B, nb] int64 slot rows, beam order
    cur_len: np.ndarray  # [B] int64 each segment's hypothesis length so far (positions written before this step)
    at_max: np.ndarray  # [B] bool: this step reaches the segment's max_length (every candidate stops)

    def meta(self) -> np.ndarray:
        """What the device step reads of the host's inputs, in one array: rows, cur_len, at_max.
        Shape: [B * nb + 2B] int64"""
        return np.concatenate([self.rows.reshape(-1), self.cur_len, self.at_max.astype(np.int64)])


def device_step(ops: ModuleType, step: BeamStepInputs, scores: torch.Tensor, parents: torch.Tensor,
                tokens: torch.Tensor, eos_id: int, history: torch.Tensor, row_scores: torch.Tensor,
                meta: torch.Tensor | None = None) -> torch.Tensor:
    """The step on the device (`ops.beam_step`: one kernel on the GPU), in place on `history` and `row_scores`;
    returns each row's next token. Nothing is read on the host (the step's lengths go up without a stream sync).
    `meta` is step.meta() on the device, uploaded here when None (a captured selection passes its static copy,
    which the host refills before each replay).
    Shape: scores [B, 2nb] float32; parents [B, 2nb] int64 (beam 0..nb-1); tokens [B, 2nb] int64;
    history [R, T] int32; row_scores [R] float32; out [B * nb] int64, rows in step.rows order."""
    b, nb = step.rows.shape
    meta = upload(step.meta(), scores.device) if meta is None else meta
    rows, lengths, at_max = meta[:b * nb].view(b, nb), meta[b * nb:b * nb + b], meta[b * nb + b:]
    return ops.beam_step(scores, parents, tokens, rows, lengths, at_max, eos_id, history, row_scores)


@dataclass
class BeamPicks:
    """A step's decisions for the segments of one beam width, as the host took them (host_step), which the engine
    applies to their searches later, while the next step runs (engine/beam_search.py BeamRows.advance)."""

    step: BeamStepInputs
    kept_parents: np.ndarray  # [B, nb] int64 the beam each beam continues (0..nb-1, the step's beam order)
    kept_tokens: np.ndarray  # [B, nb] int64 the token it continues with
    kept_scores: np.ndarray  # [B, nb] float64 (float32 values) its running score; a stopped filler's at -1e9
    stops: np.ndarray  # [B, 2nb] bool: the candidate stops (</s>, or the step reaches max_length)
    scores: np.ndarray  # [B, 2nb] float64 (float32 values) the candidates' scores, best first
    parents: np.ndarray  # [B, 2nb] int64 their beams
    tokens: np.ndarray  # [B, 2nb] int64 their tokens


def host_step(step: BeamStepInputs, scores: np.ndarray, parents: np.ndarray, tokens: np.ndarray, eos_id: int,
              row_tokens: np.ndarray) -> BeamPicks:
    """The step on the host: write each row's next token into row_tokens (indexed by slot row) and return the
    decisions for the searches.
    Shape: scores [B, 2nb] float64 (float32 values); parents, tokens [B, 2nb] int64."""
    nb = step.rows.shape[1]
    stops = (tokens == eos_id) | step.at_max[:, None]
    keep = np.argsort(stops, axis=1, kind="stable")[:, :nb]
    kept_parents = np.take_along_axis(parents, keep, 1)
    kept_tokens = np.take_along_axis(tokens, keep, 1)
    kept_scores = np.take_along_axis(scores, keep, 1)
    stopped_score = (kept_scores.astype(np.float32) + np.float32(EXCLUDED)).astype(np.float64)
    kept_scores = np.where(np.take_along_axis(stops, keep, 1), stopped_score, kept_scores)
    row_tokens[step.rows] = kept_tokens
    return BeamPicks(step, kept_parents, kept_tokens, kept_scores, stops, scores, parents, tokens)
