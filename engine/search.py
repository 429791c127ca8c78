"""Per-segment search state on the host: what every search needs (SearchContext, Candidate), and the one-row
searches, greedy and sampling (SingleSearch); beam search is engine/beam_search.py.

The device work of a step (processors, argmax, sampling, top-k over num_beams x V) is batched
over all rows in engine/selection.py; what comes back to the host is a handful of numbers per
segment, applied by the engine while the next step runs. The one-row searches of the admitted segments keep
their sequences in one table by slot row (SingleRows), which a step extends for all of them at once.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from engine.options import GenerationOptions
from engine.tokenizer import PendingTexts


def f32(x: float) -> float:
    """Round to float32, as HF's float32 tensors do after every operation."""
    return struct.unpack("f", struct.pack("f", x))[0]


@lru_cache(maxsize=4096)
def length_norm(length: int, length_penalty: float) -> float:
    """length ** length_penalty as the float32 HF divides by (the same for every segment)."""
    return f32(length ** length_penalty)


@dataclass
class SearchContext:
    """The per-segment constants every search needs."""

    options: GenerationOptions
    start_id: int  # decoder start token (</s> for NLLB)
    forced_id: int  # target-language token forced at decoder length 1
    eos_id: int
    max_length: int  # decoder sequence cap, the start token included (HF max_length)
    generator: torch.Generator | None  # sampling only: this segment's own seeded RNG
    uses_history: bool = field(init=False)  # processors read the decoder history (repetition penalty, n-grams)

    def __post_init__(self) -> None:
        self.uses_history = self.options.repetition_penalty != 1.0 or self.options.no_repeat_ngram_size > 0


@dataclass
class Candidate:
    """A finished sequence: `tokens` the ids after the forced language token, without the </s> that ended it;
    `ended` whether </s> ended it (else it ran to max_length)."""

    tokens: list[int]
    score: float
    ended: bool
    text_ref: tuple[PendingTexts, int] | None = None  # its text: row i of a block being decoded

    @property
    def text(self) -> str:
        """Its text, once its block's chunk is decoded (waiting for it)."""
        texts, i = self.text_ref
        return texts.at(i)

    @classmethod
    def of(cls, ids: list[int], score: float, eos_id: int) -> "Candidate":
        """From a whole decoder sequence `ids` (the start token first), with one slice."""
        ended = len(ids) > 1 and ids[-1] == eos_id
        return cls(ids[2:-1] if ended else ids[2:], score, ended)


# Search.plan_code: rows << 2 | these flags (engine/plan.py reads all three from one number)
HISTORY = 1  # history processors act on it (they ban </s> themselves)
SAMPLED = 2  # it samples (one row)


class SingleRows:
    """The sequences of the admitted one-row searches (greedy, sampling), by slot row, so that a step's picks are
    appended to all of them in one numpy pass (`append`): a method call a search took ~0.5 ms a step at 1,024
    rows on the 2-core machine, ~10% of the greedy corpus run's host time on the GPU machine.
    Legend: R slot rows, T decoder positions, n rows of one append."""

    def __init__(self, max_len: int, eos_id: int, max_length: np.ndarray):
        """max_length [R]: each row's search's max_length, read here and written by whoever admits the rows (the
        engine's step inputs, engine/step_inputs.py: one array for both, so that they cannot disagree)."""
        rows = max_length.shape[0]
        self.ids = np.zeros((rows, max_len), dtype=np.int32)  # [R, T] each row's sequence, decoder start first
        self.length = np.zeros(rows, dtype=np.int64)  # [R] tokens in it
        self.logprob = np.zeros(rows, dtype=np.float64)  # [R] sum of its picks' log-probs, in step order
        self.max_length = max_length
        self.eos_id = eos_id

    def start(self, rows: np.ndarray, start_ids: np.ndarray) -> None:
        """The rows begin new sequences, each its decoder start alone (one assignment a field for a whole
        admission; their max_length is already set). Shape: rows, start_ids [n] int64."""
        self.ids[rows, 0] = start_ids
        self.length[rows], self.logprob[rows] = 1, 0.0

    def append(self, rows: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> np.ndarray:
        """Each row's pick appended (float64 sums, as a Python float's); returns done [n] bool: </s>, or max_length
        reached. A row whose segment left but still computes (a batch made on the device) is clipped at T, never
        read. Shape: rows, tokens [n] int64; logprobs [n] float64."""
        at = np.minimum(self.length[rows], self.ids.shape[1] - 1)
        self.ids[rows, at] = tokens
        self.logprob[rows] += logprobs
        self.length[rows] = at + 1
        return (tokens == self.eos_id) | (at + 1 >= self.max_length[rows])

    def sequence(self, row: int) -> list[int]:
        return self.ids[row, :self.length[row]].tolist()

    def finished(self, rows: np.ndarray) -> FinishedRows:
        """The rows' sequences as their searches' candidates need them, in one conversion for all of them (a
        numpy call a row cost ~5 us each when 1,024 segments finish at once). Shape: rows [n] int64."""
        length = self.length[rows]
        ended = (length > 1) & (self.ids[rows, np.maximum(length - 1, 0)] == self.eos_id)
        count = np.maximum(length - 2 - ended, 0)
        block = self.ids[rows, 2:max(int(length.max()), 2)] if rows.size else self.ids[:0, 2:2]
        tokens = block.tolist()
        for seq, n in zip(tokens, count.tolist()):
            del seq[n:]  # in place: a fixed batch's rows are all as long as the block
        return FinishedRows(block, count, tokens, ended.tolist(), self.logprob[rows].tolist(),
                            (length - 1).tolist())


@dataclass
class FinishedRows:
    """One-row searches' sequences that ended in one step (SingleRows.finished), each cut as a Candidate's tokens
    are (after the language token, without the </s> that ended it). Legend: n rows, L the longest's tokens."""

    block: np.ndarray  # [n, L] int32 model ids, each row's tokens first (</s> and other rows' tokens past them)
    count: np.ndarray  # [n] int64 each row's tokens
    tokens: list[list[int]]  # [n] each row's tokens
    ended: list[bool]  # [n] </s> ended it (else max_length)
    logprob: list[float]  # [n] the sum of its picks' log-probs, in step order
    generated: list[int]  # [n] its picks, the language token and </s> included


class SingleSearch:
    """Greedy (argmax) or sampling (multinomial on the warped distribution): one row. While admitted its sequence
    lives in the engine's SingleRows (`bind`), which the step loop appends to for every row at once; once done it
    holds its own copy."""

    rows = 1

    def __init__(self, ctx: SearchContext):
        self.ctx = ctx
        self.plan_code = 1 << 2 | (SAMPLED if ctx.options.do_sample else 0) | (HISTORY if ctx.uses_history else 0)
        self.ids = [ctx.start_id]  # the sequence before admission (the start alone)
        self.candidate: Candidate | None = None  # once done
        self.done = False
        self.table: SingleRows | None = None
        self.row = -1

    def bind(self, table: SingleRows, row: int) -> None:
        """Admitted to slot row `row`: the sequence lives in the table from now on (the step loop starts the row
        there, `SingleRows.start`, for a whole admission at once)."""
        self.table, self.row = table, row

    def finish(self, rows: FinishedRows, i: int, texts: PendingTexts) -> None:
        """Done (the table said so): its sequence is row i of `rows`, out of the table, whose row is freed; its text
        is row i of `texts`."""
        score = rows.logprob[i] / rows.generated[i] ** self.ctx.options.length_penalty
        self.candidate = Candidate(rows.tokens[i], score, rows.ended[i], (texts, i))
        self.done, self.table = True, None

    def histories(self) -> list[list[int]]:
        """Each row's decoder sequence so far (what HF's processors see)."""
        if self.table is not None:
            return [self.table.sequence(self.row)]
        if self.candidate is None:
            return [self.ids]
        c, ctx = self.candidate, self.ctx
        return [[ctx.start_id, ctx.forced_id, *c.tokens, *([ctx.eos_id] if c.ended else [])]]

    @property
    def cur_len(self) -> int:
        return int(self.table.length[self.row]) if self.table is not None else len(self.histories()[0])

    def next_tokens(self) -> list[int]:
        return [self.histories()[0][-1]]

    def results(self) -> list[Candidate]:
        return [self.candidate]
