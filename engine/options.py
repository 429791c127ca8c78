"""Generation options (HF `generate` names and meanings) and what the engine returns: results, job futures, stats.

No torch here: the worker's broker processes (worker/processes.py) import this, never the engine itself.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.errors import InvalidRequest
from kernels.limits import BEAM_MAX


@dataclass(frozen=True)
class GenerationOptions:
    """Per-job decoding options. `None` means "the checkpoint's default" (generation_config.json).

    Greedy unless `num_beams` > 1 (beam search) or `do_sample` (multinomial sampling).
    """

    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    seed: int | None = None  # sampling seed; the same seed gives the same output in any batch
    no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    max_new_tokens: int | None = None  # None: the checkpoint's max_length (NLLB: 200 total)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequest naming the first bad value, the accepted range, and what to do."""
        _check_int("num_beams", self.num_beams, 1, BEAM_MAX)
        _check_int("num_return_sequences", self.num_return_sequences, 1, BEAM_MAX)
        if self.num_return_sequences > self.num_beams and not self.do_sample:
            raise InvalidRequest(
                f"num_return_sequences={self.num_return_sequences} exceeds num_beams="
                f"{self.num_beams}; set num_beams >= num_return_sequences")
        if self.do_sample and self.num_beams > 1:
            raise InvalidRequest(
                "do_sample with num_beams > 1 (beam sampling) is not supported; "
                "use do_sample with num_beams=1, or beam search without do_sample")
        if self.do_sample and self.num_return_sequences > 1:
            raise InvalidRequest(
                "num_return_sequences > 1 is supported with beam search only; "
                "submit the segment several times with different seeds instead")
        _check_float("length_penalty", self.length_penalty, -10.0, 10.0)
        _check_float("temperature", self.temperature, 1e-4, 100.0, low_open=False)
        _check_int("top_k", self.top_k, 0, 1_000_000)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**63 - 1)
        _check_int("no_repeat_ngram_size", self.no_repeat_ngram_size, 0, 64)
        _check_float("repetition_penalty", self.repetition_penalty, 1e-4, 100.0)
        _check_int("min_new_tokens", self.min_new_tokens, 0, 4096)
        if self.max_new_tokens is not None:
            _check_int("max_new_tokens", self.max_new_tokens, 1, 4096)
            if self.min_new_tokens > self.max_new_tokens:
                raise InvalidRequest(
                    f"min_new_tokens={self.min_new_tokens} exceeds max_new_tokens="
                    f"{self.max_new_tokens}; lower min_new_tokens or raise max_new_tokens")
        if not isinstance(self.do_sample, bool) or not isinstance(self.early_stopping, bool):
            raise InvalidRequest("do_sample and early_stopping must be true or false")

    @property
    def rows_per_segment(self) -> int:
        """Decoder rows one segment occupies in the slot table."""
        return self.num_beams


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(f"{name}={value!r} is out of range; expected an integer in [{low}, {high}]")


def _check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low < value if low_open else low <= value) and value <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise InvalidRequest(f"{name}={value!r} is out of range; expected a number in {bracket}{low}, {high}]")


@dataclass
class Hypothesis:
    """One generated sequence. `tokens`: ids after the forced language token, without `</s>`."""

    text: str
    tokens: list[int]
    score: float  # log-prob sum / length ** length_penalty (HF `sequences_scores`)


@dataclass
class Translation:
    """The answer for one segment: the best hypothesis, plus the n best when asked for."""

    text: str
    tokens: list[int]
    score: float
    hypotheses: list[Hypothesis] = field(default_factory=list)  # n best, best first (n > 1 only)
    src_tokens: int = 0  # source length in tokens, language code and </s> included
    warnings: list[str] = field(default_factory=list)  # engine.text.quality codes; empty: nothing to say
    detected_lang: str | None = None  # src_lang "auto": the language identified (FLORES code)
    detected_confidence: float | None = None  # and how sure the identifier was (0..1)
    retried: bool = False  # on_warning="retry" re-decoded the segment and kept the retry
    truncated: bool = False  # the best hypothesis ran to max_length without </s>


@dataclass
class SegmentResult:
    """One sentence of a document and its translation."""

    source: str
    translation: Translation


@dataclass
class Usage:
    """What a document job cost. Tokens count the unique segments decoded (a repeated sentence once)."""

    segments: int  # sentences in the document
    unique_segments: int  # sentences decoded
    src_tokens: int
    tgt_tokens: int
    queued_s: float  # from submission to the first segment taking rows
    compute_s: float  # from then to the last segment's translation


@dataclass
class DocumentTranslation:
    """A translated document: `text` is the source's layout with each sentence translated."""

    text: str
    segments: list[SegmentResult]  # in document order
    detected_lang: str | None  # src_lang "auto": the document's language
    detected_confidence: float | None
    usage: Usage


@dataclass
class EngineStats:
    rows_total: int
    rows_used: int
    jobs_waiting: int  # jobs with a segment not yet admitted
    jobs_running: int  # jobs with a segment in the table
    tokens_generated: int  # cumulative, every row's every step
    cancelled_jobs: int = 0  # cumulative: jobs cancelled before they finished
    rows_freed_by_cancel: int = 0  # cumulative: rows those jobs held when cancelled


class JobFuture(Future):
    """The future of a job: list[Translation] in text order (submit), or a DocumentTranslation
    (submit_document). `started_at`: time.monotonic() when the job's first segment took rows (None
    before), so callers can tell waiting from work.

    `cancel()` asks the engine to drop the job: off the admission queue, or its rows freed at the
    next step boundary; the future then raises engine.errors.Cancelled (it never enters the
    concurrent.futures "cancelled" state). True when the request was taken (the job had not finished)."""

    started_at: float | None = None
    total: int = 0  # answer positions: the texts, or the document's sentences (set at submission)
    _canceller: Callable[[], bool] | None = None  # set by the engine at submission

    def cancel(self) -> bool:
        canceller = self._canceller  # once: the engine drops it when the job settles
        return not self.done() and canceller is not None and canceller()
