"""Jobs and their segments: what a request asked for, and how its finished segments become its answer.

A job (one request: texts, or a document) holds its unique segments (source sentences, a repeated
one once); each is admitted on its own by the scheduler (engine/scheduler.py) and decoded by the step
loop. As each finishes, the job records its translation under every position it answers, tells the
submitter through `on_segment`, and, once the last is in, resolves its future with `resolve(job)`:
the list of Translations of a texts job, or a document's DocumentTranslation. With on_warning="retry"
a flagged segment is decoded once more before it counts as finished (`finish_segment`).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from engine.beam_search import BeamSearch
from engine.options import JobFuture, Translation
from engine.search import SingleSearch

log = logging.getLogger("engine")

OnSegment = Callable[[int, Translation], None]
Search = SingleSearch | BeamSearch


@dataclass(frozen=True)
class Source:
    """What the text services know of one unique segment's source (None for a token-ids job)."""

    text: str
    lang: str  # FLORES code: given, or detected for src_lang "auto"
    detected_confidence: float | None = None  # src_lang "auto" only


@dataclass(eq=False)
class Segment:
    job: "Job"
    index: int  # the job's unique segment it decodes
    src_ids: list[int]  # [src_lang] pieces </s>
    search: Search
    rows: list[int] = field(default_factory=list)  # slot rows, one per live hypothesis
    src_start: int = -1  # first source-pool token of this segment's cross-attention KV
    adapter_slot: int = 0  # LoRA stack slot held while running (0: base model)
    flagged: Translation | None = None  # a retry's: the first decode's translation, whose warnings it retries


@dataclass(eq=False)
class Job:
    future: JobFuture
    adapter: str | None
    deadline: float | None  # epoch seconds: a job not finished by then fails (Scheduler.expire)
    positions: list[list[int]]  # per unique segment, the answer positions it fills (texts or sentences)
    resolve: Callable[["Job"], object]  # the future's value, made once every segment finished
    sources: list[Source] | None = None  # per unique segment (None: a token-ids job: no text services)
    tgt_lang: str = ""
    on_segment: OnSegment | None = None
    retry_search: Callable[[], Search] | None = None  # on_warning="retry": a fresh search with the retry's options
    job_id: str | None = None
    check_output: bool = False  # give each translation its warnings (engine/text/quality.py)
    submitted_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    segments: list[Segment] = field(default_factory=list)  # one per unique segment (retries not included)
    pending: deque[Segment] = field(default_factory=deque)  # segments waiting for rows, in order
    rows_held: int = 0  # slot rows its running segments hold
    small: bool = True  # its segments need no more rows in all than the scheduler's per-job cap
    results: list[Translation | None] = field(default_factory=list)  # per unique segment
    unfinished: int = 0  # unique segments without a result yet
    failed: bool = False  # failed or cancelled: its segments are dropped

    def __post_init__(self) -> None:
        self.results = [None] * len(self.positions)
        self.unfinished = len(self.positions)

    @property
    def answers(self) -> list[Translation]:
        """One Translation per answer position (a repeated sentence's at each of its positions)."""
        out: list[Translation | None] = [None] * sum(len(p) for p in self.positions)
        for result, positions in zip(self.results, self.positions):
            for at in positions:
                out[at] = result
        return out

    def finish_segment(self, seg: Segment, translation: Translation) -> Segment | None:
        """Record a finished segment's translation, or, when on_warning="retry" and it carries warnings, return
        the segment that decodes it again (to queue; it finishes here too). Of a retry, the retry is kept only
        if it has no warnings, marked retried; else the first translation, with its warnings."""
        if seg.flagged is None and translation.warnings and self.retry_search is not None:
            return Segment(self, seg.index, seg.src_ids, self.retry_search(), flagged=translation)
        if seg.flagged is not None:
            if translation.warnings:
                translation = seg.flagged
            else:
                translation.retried = True
        self.results[seg.index] = translation
        self.unfinished -= 1
        self._tell(seg.index, translation)
        if self.unfinished == 0:
            self.finished_at = time.monotonic()
            self.settle(self.resolve(self))
        return None

    def settle(self, value: object = None, error: BaseException | None = None) -> None:
        """Resolve the future with `value`, or with `error` (once: a settled job is left as it is), then drop
        what ties the job's objects into cycles (its segments back to it, the future's canceller to it), so
        that they are freed as soon as the submitter lets go of the future, not by the cyclic collector, whose
        passes grow with everything in flight."""
        if not self.future.done():
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)
        self.future._canceller = None
        self.segments = []
        self.pending.clear()

    def _tell(self, index: int, translation: Translation) -> None:
        """on_segment for each position the segment answers; a callback's exception is logged, never raised."""
        if self.on_segment is None:
            return
        for at in self.positions[index]:
            try:
                self.on_segment(at, translation)
            except Exception:  # noqa: BLE001 - the submitter's bug must not stop the engine
                log.exception("on_segment callback failed for segment %d of job %s", at, self.job_id)
