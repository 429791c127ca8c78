"""A document as sentences to translate and the whitespace around them (its layout).

    doc == gaps[0] + sentences[0] + gaps[1] + ... + sentences[n-1] + gaps[n]      (always)

Every line break ends a sentence (subtitles, lists and addresses keep their lines). Inside a line,
engine.text.boundaries finds the sentence ends for the source language. Every sentence is
stripped; all whitespace (line breaks, CRLF, blank lines, indentation, the spaces between
sentences, Unicode spaces) stays in the gaps, so `reassemble` puts translations back between the
source's own whitespace.

A sentence over the model's source-token limit is cut into pieces under it, at the best boundary:
clause punctuation, else whitespace, else between characters (a run without spaces). The longest
prefix that fits is found by galloping then binary search, so a line of n characters costs
O(n log n) characters tokenized, never a count per character.
"""
from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Callable, Sequence

from engine.text.boundaries import sentence_ends

# Every character str.isspace() accepts, and the invisible ones a text may carry at its edges
# (zero width space, word joiner, byte order mark).
SPACE = "\t\n\v\f\r\x1c\x1d\x1e\x1f \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200C))) \
    + "\u2028\u2029\u202f\u205f\u2060\u3000\ufeff"
# What ends a line: CRLF first so that it stays one break.
_LINE_BREAK = re.compile(r"\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
# Punctuation that ends a clause when a space follows it ...
_CLAUSE_PUNCT = frozenset(",;:.!?…—–،؛؟۔।॥።፣፤፥፦፧։჻།༎។៕၊။")
# ... and fullwidth punctuation that ends one with no space after it.
_CLAUSE_PUNCT_UNSPACED = frozenset("、，；：。！？｡､")
# Where a run is cut between characters, these must stay with the character before them.
_JOINING_CATEGORIES = frozenset({"Mn", "Mc", "Me"})
_ZWJ_AND_SELECTORS = frozenset("\u200d\ufe0e\ufe0f")

Span = tuple[int, int]  # [start, end) of a stripped, non-empty sentence in the document


@dataclass(frozen=True)
class Layout:
    """doc == gaps[0] + sentences[0] + gaps[1] + ... + sentences[n-1] + gaps[n]  (exactly, always).
    sentences[i] is stripped (no leading/trailing whitespace) and non-empty; gaps hold all whitespace
    (line breaks, blank lines, indentation, spaces between sentences, CRLF, Unicode spaces)."""
    gaps: tuple[str, ...]        # [n + 1]
    sentences: tuple[str, ...]   # [n]


def split_document(doc: str, lang: str | None, count_tokens: Callable[[str], int] | None = None,
                   max_tokens: int | None = None) -> Layout:
    """Sentences of `doc` for source language `lang` (a FLORES code; None or an unknown code
    gets the language-neutral rules) and the whitespace between them.

    With `count_tokens` and `max_tokens`, a sentence with count_tokens(s) > max_tokens is cut into
    pieces that fit (see the module doc); a piece is never refused, even a single character
    that does not fit on its own."""
    spans = [span for line in _line_spans(doc) for span in _sentence_spans(doc, line, lang)]
    if count_tokens is not None and max_tokens is not None:
        spans = [piece for span in spans for piece in _fitting_spans(doc, span, count_tokens, max_tokens)]
    return _layout(doc, spans)


_UNSPACED_SENTENCE_END = frozenset("。！？｡")  # Chinese and Japanese end a sentence with no space after it
_UNSPACED_SCRIPTS = frozenset({"Hans", "Hant", "Jpan"})  # ... and so do their translations


def for_target(layout: Layout, tgt_lang: str) -> Layout:
    """The layout translations into `tgt_lang` go back into: the source's own, except that an empty gap after
    a Chinese or Japanese sentence end becomes one space when `tgt_lang` writes spaces between sentences
    (else "今天很好。再见。" into English would read "It is fine today.Goodbye.")."""
    if tgt_lang.rpartition("_")[2] in _UNSPACED_SCRIPTS:
        return layout
    gaps = list(layout.gaps)
    for i, sentence in enumerate(layout.sentences[:-1]):
        if not gaps[i + 1] and sentence[-1] in _UNSPACED_SENTENCE_END:
            gaps[i + 1] = " "
    return Layout(tuple(gaps), layout.sentences)


def reassemble(layout: Layout, translated: Sequence[str]) -> str:
    """gaps[0] + translated[0] + gaps[1] + ... + translated[n-1] + gaps[n]."""
    if len(translated) != len(layout.sentences):
        raise ValueError(f"{len(translated)} translations for a layout of {len(layout.sentences)} sentences")
    parts = [layout.gaps[0]]
    for text, gap in zip(translated, layout.gaps[1:]):
        parts += (text, gap)
    return "".join(parts)


def _line_spans(doc: str) -> list[Span]:
    """[start, end) of each line's text without its line break."""
    spans: list[Span] = []
    start = 0
    for brk in _LINE_BREAK.finditer(doc):
        spans.append((start, brk.start()))
        start = brk.end()
    spans.append((start, len(doc)))
    return spans


def _strip_span(doc: str, start: int, end: int) -> Span:
    """[start, end) narrowed to its text without leading and trailing SPACE (empty if none)."""
    while start < end and doc[start] in SPACE:
        start += 1
    while end > start and doc[end - 1] in SPACE:
        end -= 1
    return start, end


def _sentence_spans(doc: str, line: Span, lang: str | None) -> list[Span]:
    start, end = _strip_span(doc, *line)
    if start == end:
        return []
    bounds = [start, *(start + cut for cut in sentence_ends(doc[start:end], lang)), end]
    spans = [_strip_span(doc, a, b) for a, b in zip(bounds, bounds[1:])]
    return [(a, b) for a, b in spans if a < b]


def _fitting_spans(doc: str, span: Span, count_tokens: Callable[[str], int], max_tokens: int) -> list[Span]:
    """`span` cut into stripped pieces with count_tokens(piece) <= max_tokens (see module doc)."""
    start, end = span
    if count_tokens(doc[start:end]) <= max_tokens:
        return [span]

    def fits(stop: int) -> bool:
        return count_tokens(doc[start:stop]) <= max_tokens

    pieces: list[Span] = []
    while start < end:
        limit = _longest_fit(start, end, fits, first_step=max_tokens)
        if limit == end:
            pieces.append((start, end))
            break
        cut = _best_cut(doc, start, limit, end)
        while cut < limit and not fits(cut):  # tokens are not monotonic in length: check the piece
            limit = cut - 1
            cut = _best_cut(doc, start, limit, end)
        pieces.append(_strip_span(doc, start, cut))
        start = _strip_span(doc, cut, end)[0]
    return pieces


def _longest_fit(start: int, end: int, fits: Callable[[int], bool], first_step: int) -> int:
    """The largest stop in (start, end] with fits(stop), by galloping then binary search; start
    when not even one character fits."""
    fit, step = start, max(first_step, 1)
    while True:
        stop = min(start + step, end)
        if not fits(stop):
            break
        if stop == end:
            return end
        fit, step = stop, step * 2
    while stop - fit > 1:
        mid = (fit + stop) // 2
        if fits(mid):
            fit = mid
        else:
            stop = mid
    return fit


def _best_cut(doc: str, start: int, limit: int, end: int) -> int:
    """Where to end the piece that starts at `start` and fits up to `limit`: after the last clause
    punctuation, else before the last whitespace, in the second half of the room first, then in
    all of it; else between characters at `limit` (at least one character)."""
    half = start + (limit - start) // 2
    for lowest in (half, start + 1):
        for is_cut in (_is_clause_cut, _is_space_cut):
            for cut in range(limit, lowest - 1, -1):
                if is_cut(doc, cut, end):
                    return cut
    return _character_cut(doc, start, max(limit, start + 1), end)


def _is_clause_cut(doc: str, cut: int, end: int) -> bool:
    before = doc[cut - 1]
    if before in _CLAUSE_PUNCT_UNSPACED:
        return True
    return before in _CLAUSE_PUNCT and cut < end and doc[cut] in SPACE


def _is_space_cut(doc: str, cut: int, end: int) -> bool:
    return cut < end and doc[cut] in SPACE and doc[cut - 1] not in SPACE


def _character_cut(doc: str, start: int, cut: int, end: int) -> int:
    """`cut` moved back off combining marks and joiners so that a character keeps them; forward
    past them when going back would leave the piece empty."""
    if cut >= end:
        return end
    back = cut
    while back > start + 1 and _joins_previous(doc[back]):
        back -= 1
    if not _joins_previous(doc[back]):
        return back
    while cut < end and _joins_previous(doc[cut]):
        cut += 1
    return cut


def _joins_previous(ch: str) -> bool:
    return ch in _ZWJ_AND_SELECTORS or unicodedata.category(ch) in _JOINING_CATEGORIES


def _layout(doc: str, spans: list[Span]) -> Layout:
    bounds = [0, *(i for span in spans for i in span), len(doc)]
    gaps = tuple(doc[a:b] for a, b in zip(bounds[::2], bounds[1::2]))
    return Layout(gaps=gaps, sentences=tuple(doc[a:b] for a, b in spans))
