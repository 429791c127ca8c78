"""What finished segments' searches become: their candidates' texts, and each segment's Translation with what a
user should know of it (warnings, engine.text.quality; the detected source language)."""
from __future__ import annotations

from itertools import chain

from engine.jobs import Segment
from engine.options import Hypothesis, Translation
from engine.search import Candidate
from engine.text.quality import translation_warnings
from engine.tokenizer import Tokenizer


def candidates(segments: list[Segment], tokenizer: Tokenizer) -> list[list[Candidate]]:
    """Each segment's n best (search.Candidate), every one with its text: a one-row search's is already being
    decoded with the rows that ended beside it; the others' are decoded here together
    (Tokenizer.decode_many)."""
    found = [seg.search.results() for seg in segments]
    untold = [c for c in chain.from_iterable(found) if c.text_ref is None]
    if untold:
        texts = tokenizer.decode_many([c.tokens for c in untold])
        for i, c in enumerate(untold):
            c.text_ref = (texts, i)
    return found


def translation(seg: Segment, found: list[Candidate]) -> Translation:
    """The segment's answer from its n best (`candidates`), waiting for their texts if they are still being
    decoded. Warnings for jobs with source text (a token-ids job has none)."""
    best = found[0]
    hyps = [Hypothesis(c.text, c.tokens, c.score) for c in found] if len(found) > 1 else []
    out = Translation(best.text, best.tokens, best.score, hyps, len(seg.src_ids), truncated=not best.ended)
    job = seg.job
    if job.sources is not None:
        source = job.sources[seg.index]
        if job.check_output:
            out.warnings = translation_warnings(source.text, source.lang, job.tgt_lang, out)
        if source.detected_confidence is not None:
            out.detected_lang, out.detected_confidence = source.lang, source.detected_confidence
    return out
