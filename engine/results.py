"""What a finished segment's search becomes: its hypotheses as text, and what a user should know of the
best one (warnings, engine.text.quality; the detected source language)."""
from __future__ import annotations

from engine.jobs import Segment
from engine.options import Hypothesis, Translation
from engine.text.quality import translation_warnings
from engine.tokenizer import Tokenizer


def translation(seg: Segment, tokenizer: Tokenizer, eos_id: int) -> Translation:
    """The segment's n best as text (ids after the forced language token, without </s>). Warnings for jobs
    with source text (a token-ids job has none); `truncated` when the best ran to max_length without </s>."""
    hyps, candidates = [], seg.search.results()
    for cand in candidates:
        ids = cand.ids[1:]  # drop the forced language token
        if ids and ids[-1] == eos_id:
            ids = ids[:-1]
        hyps.append(Hypothesis(tokenizer.decode(ids), ids, cand.score))
    best = hyps[0]
    out = Translation(best.text, best.tokens, best.score, hyps if len(hyps) > 1 else [], len(seg.src_ids),
                      truncated=not candidates[0].ids or candidates[0].ids[-1] != eos_id)
    job = seg.job
    if job.sources is not None:
        source = job.sources[seg.index]
        if job.check_output:
            out.warnings = translation_warnings(source.text, source.lang, job.tgt_lang, out)
        if source.detected_confidence is not None:
            out.detected_lang, out.detected_confidence = source.lang, source.detected_confidence
    return out
