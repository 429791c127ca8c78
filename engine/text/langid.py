"""Language identification for `src_lang: "auto"` and the off_target warning (pure, host only).

The identifier is py3langid's naive Bayes model over byte n-grams (140 labels, 124 NLLB
languages), read from the file inside its package: nothing is downloaded, ever. Its probabilities
are normalised with a length-dependent temperature, so a confidence means about the same on a
short and on a long text; it has a class `zxx` for text with no language (gibberish, code, digits).
Why this library and not fastText lid.176 or lingua: docs/language.md (coverage, accuracy, speed).

The model (~130 MiB resident, ~0.3 s to load) is loaded once, on first use, under a lock; after
that detection is read-only and threads may call it concurrently.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

from engine.text.flores_map import flores_candidates, to_flores
from engine.text.scripts import script_counts

DEFAULT_THRESHOLD = 0.5  # below: unknown_language (docs/language.md: what it costs in recall)
NO_LANGUAGE = "zxx"  # the identifier's label for text without language
MAX_CHARS = 2000  # detection reads at most this much of a text: enough to be sure, bounded time
DOCUMENT_CHARS = 300  # detect_document reads the longest sentences until it has this much text
DOCUMENT_SENTENCES = 8  # ... or this many sentences
_GUESSES = 3


@dataclass(frozen=True)
class Detection:
    lang: str | None  # FLORES-200 code NLLB translates, or None (unknown / not confident / not NLLB)
    confidence: float  # 0..1 of the best guess
    guesses: tuple[tuple[str, float], ...]  # best first, up to 3: FLORES where mappable, else ISO


_lock = threading.Lock()
_identifier = None


def _model():
    """The py3langid identifier, loaded on first use (module import stays cheap)."""
    global _identifier
    if _identifier is None:
        with _lock:
            if _identifier is None:
                from py3langid.langid import MODEL_FILE, LanguageIdentifier

                _identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    return _identifier


def library_labels() -> tuple[str, ...]:
    """The ISO codes the identifier can answer, `zxx` included."""
    return tuple(_model().labels)


_covered_codes: frozenset[str] | None = None


def covers(flores_code: str) -> bool:
    """True when the identifier can recognise this NLLB language."""
    global _covered_codes
    if _covered_codes is None:
        _covered_codes = frozenset().union(*map(flores_candidates, library_labels()))
    return flores_code in _covered_codes


def detect(text: str, threshold: float = DEFAULT_THRESHOLD) -> Detection:
    """The NLLB language of `text`. lang is None below `threshold`, for a language NLLB does not
    translate, for text without language (`zxx`) and for text without letters; the best guesses
    come with it either way (none for text without letters)."""
    text = text[:MAX_CHARS]
    if not script_counts(text):
        return Detection(None, 0.0, ())
    ranked = _model().rank(text)[:_GUESSES]
    guesses = tuple((to_flores(iso, text) or iso, round(float(p), 4)) for iso, p in ranked)
    best_iso, best_p = ranked[0]
    flores = to_flores(best_iso, text) if best_iso != NO_LANGUAGE else None
    confidence = float(best_p)
    lang = flores if confidence >= threshold else None
    return Detection(lang, confidence, guesses)


def detect_document(sentences: Sequence[str], threshold: float = DEFAULT_THRESHOLD) -> Detection:
    """One detection for a whole document, on its longest sentences: longest first until
    DOCUMENT_CHARS of text or DOCUMENT_SENTENCES sentences. Long sentences carry the most
    evidence; a document's short lines (names, numbers, headings) the least, and past a few
    hundred characters more text no longer changes the answer, only the time."""
    picked: list[str] = []
    size = 0
    for s in sorted(sentences, key=len, reverse=True)[:DOCUMENT_SENTENCES]:
        if size >= DOCUMENT_CHARS:
            break
        picked.append(s)
        size += len(s) + 1
    return detect(" ".join(picked), threshold)


__all__ = ["DEFAULT_THRESHOLD", "Detection", "covers", "detect", "detect_document", "to_flores"]
