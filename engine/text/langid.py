"""Language identification for `src_lang: "auto"` and the off_target warning (pure, host only).

The identifier is py3langid's naive Bayes model over byte n-grams (140 labels, 124 NLLB
languages), read from the file inside its package: nothing is downloaded, ever. Its probabilities
are normalised with a length-dependent temperature, so a confidence means about the same on a
short and on a long text; it has a class `zxx` for text with no language (gibberish, code, digits).
Why this library and not fastText lid.176 or lingua: docs/language.md (coverage, accuracy, speed).

The model (~130 MiB resident, ~0.3 s to load; its feature table kept as float32, 57 MiB in place of
the float16 table's 28) is loaded once, on first use, under a lock; after that detection is read-only
and threads may call it concurrently.
"""
from __future__ import annotations

import math
import threading
import unicodedata
from dataclasses import dataclass
from typing import Sequence

import numpy as np

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


class _Scorer:
    """py3langid's `rank` with `norm_probs`, scored from its model's arrays: the same byte n-gram walk, the
    naive Bayes sums over a float32 copy of its float16 feature table (the library converts the rows it reads on
    every call, which with the sort of all 140 labels in Python made ~70 us of a ~100-character sentence), and
    the best labels found with numpy. The same probabilities, in the same order (tests hold them to `rank`)."""

    def __init__(self, lib) -> None:
        from py3langid.langid import visit_counts

        self._visit = visit_counts
        self._nextmove, self._output = lib.tk_nextmove, lib.tk_output
        self._rowbase = [row << 8 for row in lib.tk_row]
        self._table = lib.nb_ptc.astype(np.float32)  # [features, classes]
        self._prior = lib.nb_pc  # [classes] float32
        first: dict[str, int] = {}
        for i, label in enumerate(lib.nb_classes):
            first.setdefault(label, i)
        self.labels = tuple(first)  # distinct, as `rank` lists them (srl and sr share one)
        self._columns = np.fromiter(first.values(), dtype=np.intp, count=len(first))  # each label's first column
        self._aliases = [(first[label], i) for i, label in enumerate(lib.nb_classes) if first[label] != i]

    def best(self, text: str, n: int) -> list[tuple[str, float]]:
        """The n most probable labels of `text` and their probabilities, best first (ties in label order)."""
        if text.isupper():
            text = text.lower()
        data = unicodedata.normalize("NFC", text).encode("utf8", errors="surrogatepass")
        visits = self._visit(self._nextmove, self._rowbase, self._output, data)
        if visits:
            idx = np.fromiter(visits.keys(), dtype=np.intp, count=len(visits))
            counts = np.fromiter(visits.values(), dtype=np.float32, count=len(visits))
            scores = np.log1p(counts) @ self._table[idx] + self._prior
        else:  # no feature: every class alike
            scores = np.zeros(self._prior.shape[0], dtype=np.float32)
        scores *= 1.0 / math.sqrt(len(data) or 1)  # the library's temperature: sqrt(bytes)
        np.exp(scores - scores.max(), out=scores)
        scores /= scores.sum()
        for keep, dupe in self._aliases:
            scores[keep] += scores[dupe]
        merged = scores[self._columns]
        order = np.argsort(-merged, kind="stable")[:n]
        return [(self.labels[i], float(merged[i])) for i in order.tolist()]


_lock = threading.Lock()
_scorer: _Scorer | None = None


def _model() -> _Scorer:
    """The identifier, loaded on first use (module import stays cheap)."""
    global _scorer
    if _scorer is None:
        with _lock:
            if _scorer is None:
                from py3langid.langid import MODEL_FILE, LanguageIdentifier

                _scorer = _Scorer(LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True))
    return _scorer


def library_labels() -> tuple[str, ...]:
    """The ISO codes the identifier can answer, `zxx` included."""
    return _model().labels


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
    ranked = _model().best(text, _GUESSES)
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
