"""What finished segments' searches become: their hypotheses as text, and what a user should know of the best
one (warnings, engine.text.quality; the detected source language)."""
from __future__ import annotations

from engine.jobs import Segment
from engine.options import Hypothesis, Translation
from engine.text.quality import translation_warnings
from engine.tokenizer import Tokenizer


def hypotheses(segments: list[Segment], tokenizer: Tokenizer, eos_id: int) -> list[tuple[list[Hypothesis], bool]]:
    """Each segment's n best (ids after the forced language token, without </s>), the texts of all of them made
    in one batch (Tokenizer.decode_batch), and whether the best ran to max_length without </s>."""
    found = [seg.search.results() for seg in segments]
    ids = [[_generated(c.ids, eos_id) for c in candidates] for candidates in found]
    texts = iter(tokenizer.decode_batch([hyp for of_segment in ids for hyp in of_segment]))
    return [([Hypothesis(next(texts), hyp, c.score) for hyp, c in zip(of_segment, candidates)],
             not candidates[0].ids or candidates[0].ids[-1] != eos_id) for of_segment, candidates in zip(ids, found)]


def _generated(ids: list[int], eos_id: int) -> list[int]:
    """A candidate's ids after the forced language token, without the </s> that ended it."""
    ids = ids[1:]
    return ids[:-1] if ids and ids[-1] == eos_id else ids


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
