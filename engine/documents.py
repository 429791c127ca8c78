"""A document job's text side: its sentences (engine.text.segment), each distinct one decoded once, and
the answer put back together in the source's layout."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.jobs import Job
from engine.options import DocumentTranslation, SegmentResult, Usage
from engine.text.segment import Layout, for_target, reassemble, split_document


@dataclass(frozen=True)
class DocumentPlan:
    layout: Layout
    unique: list[str]  # the distinct sentences, in order of first appearance
    positions: list[list[int]]  # per distinct sentence, the indices of the sentences it is
    detected_lang: str | None = None  # src_lang "auto": the document's language and the identifier's confidence
    detected_confidence: float | None = None


def plan_document(doc: str, lang: str | None, count_tokens: Callable[[str], int], max_tokens: int) -> DocumentPlan:
    """The document's sentences for `lang`, each under max_tokens (a longer one is cut at its best boundaries,
    never refused), and which of them are the same."""
    layout = split_document(doc, lang, count_tokens, max_tokens)
    first: dict[str, int] = {}
    positions: list[list[int]] = []
    for i, sentence in enumerate(layout.sentences):
        at = first.setdefault(sentence, len(positions))
        if at == len(positions):
            positions.append([])
        positions[at].append(i)
    return DocumentPlan(layout, list(first), positions)


def answer_document(plan: DocumentPlan, job: Job) -> DocumentTranslation:
    """The finished job's translations between the source's own whitespace (`for_target`: a space where a
    Chinese or Japanese sentence end had none and the target writes one)."""
    translations = job.answers
    started = job.future.started_at if job.future.started_at is not None else job.submitted_at
    usage = Usage(len(translations), len(plan.unique), sum(t.src_tokens for t in job.results),
                  sum(len(t.tokens) for t in job.results), started - job.submitted_at, job.finished_at - started)
    return DocumentTranslation(reassemble(for_target(plan.layout, job.tgt_lang), [t.text for t in translations]),
                               [SegmentResult(s, t) for s, t in zip(plan.layout.sentences, translations)],
                               plan.detected_lang, plan.detected_confidence, usage)
