"""What finished segments' searches become: their hypotheses as text, and what a user should know of the best
one (warnings, engine.text.quality; the detected source language)."""
from __future__ import annotations

from itertools import chain

from engine.jobs import Segment
from engine.options import Hypothesis, Translation
from engine.text.quality import translation_warnings
from engine.tokenizer import Tokenizer


def hypotheses(segments: list[Segment], tokenizer: Tokenizer) -> list[tuple[list[Hypothesis], bool]]:
    """Each segment's n best (search.Candidate), the texts of all of them made in one batch
    (Tokenizer.decode_batch), and whether the best ran to max_length without </s>. All segments' candidates are
    one flat list, cut into segments at the end: comprehensions nested per segment cost ~0.6 ms more when 1,024
    segments finish at once (the 2-core machine)."""
    found = [seg.search.results() for seg in segments]
    candidates = list(chain.from_iterable(found))
    tokens = [c.tokens for c in candidates]
    hyps = list(map(Hypothesis, tokenizer.decode_batch(tokens), tokens, [c.score for c in candidates]))
    out, at = [], 0
    for of_segment in found:
        out.append((hyps[at:at + len(of_segment)], not of_segment[0].ended))
        at += len(of_segment)
    return out


def translation(seg: Segment, hyps: list[Hypothesis], truncated: bool) -> Translation:
    """The segment's answer from its n best (`hypotheses`). Warnings for jobs with source text (a token-ids job
    has none)."""
    best = hyps[0]
    out = Translation(best.text, best.tokens, best.score, hyps if len(hyps) > 1 else [], len(seg.src_ids),
                      truncated=truncated)
    job = seg.job
    if job.sources is not None:
        source = job.sources[seg.index]
        if job.check_output:
            out.warnings = translation_warnings(source.text, source.lang, job.tgt_lang, out)
        if source.detected_confidence is not None:
            out.detected_lang, out.detected_confidence = source.lang, source.detected_confidence
    return out
