"""Warnings on a translation a user should look at (pure, host only, microseconds per output).

    repetition    an n-gram loop: the share of repeated 2-, 3- or 4-grams of the output tokens, or
                  one token repeated in a run
    length_ratio  output/source characters outside the band the two languages' scripts allow
    off_target    the output is not in tgt_lang: mostly another script than tgt_lang's, or the
                  identifier is sure of another language
    truncated     the output reached max_new_tokens without </s> (the engine knows; passed in)

Every threshold was set on the toy model's outputs (docs/language.md, "Output warnings"): each is
silent on all 900 normal outputs and fires on the crafted failures. The toy model writes Latin
pseudo-words that the identifier scores at most 0.67 for any language, so off_target's identifier
rule asks for a confidence of 0.9 and 20 letters; a toy output in Latin script for a Cyrillic or
Han target trips the script rule.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from engine.text.langid import covers, detect
from engine.text.scripts import script_counts, script_share

if TYPE_CHECKING:
    from engine.options import Translation

WARNING_CODES = ("repetition", "length_ratio", "off_target", "truncated")

# repetition
NGRAM_SIZES = (2, 3, 4)
MIN_REPETITION_TOKENS = 8  # shorter outputs have too few n-grams to call a loop
REPEATED_NGRAM_SHARE = 0.4  # 1 - distinct/total n-grams; normal toy outputs 0.0, loops >= 0.8
TOKEN_RUN = 8  # the same token this many times in a row; normal toy outputs <= 2

# length_ratio: characters a script needs for the same content, relative to Latin (about what
# FLORES-200 sentences take: Chinese ~1/3 of English's characters, Korean ~1/2 ...)
SCRIPT_DENSITY: dict[str, float] = {
    "Hans": 0.33, "Hant": 0.33, "Jpan": 0.45, "Hang": 0.5, "Ethi": 0.6, "Hebr": 0.8, "Arab": 0.85,
    "Thai": 0.9, "Laoo": 0.9, "Khmr": 0.95, "Tibt": 1.0, "Mymr": 1.1,
}
LENGTH_BAND = (0.3, 3.0)  # allowed output/source x density(src)/density(tgt); toy 0.36 .. 1.25
MIN_LENGTH_SOURCE_CHARS = 10  # a shorter source gives too noisy a ratio (toy: 0.25 on 8 chars)

# off_target
MIN_SCRIPT_LETTERS = 8  # letters an output needs before its script is judged
MIN_TARGET_SCRIPT_SHARE = 0.5  # below: most letters are in another script than tgt_lang's
MIN_IDENTIFY_LETTERS = 20  # letters an output needs before the identifier is asked
OFF_TARGET_CONFIDENCE = 0.9  # the identifier must be this sure of another language
TARGET_GUESS_FLOOR = 0.05  # ... and give tgt_lang less than this


def _repeated_share(grams: list[tuple[int, ...]]) -> float:
    """1 - distinct/total over `grams` (0.0 when there are none)."""
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def _longest_run(tokens: Sequence[int]) -> int:
    run = longest = 0
    prev = None
    for t in tokens:
        run = run + 1 if t == prev else 1
        prev = t
        longest = max(longest, run)
    return longest


def _repetition(tokens: Sequence[int]) -> bool:
    """A loop anywhere, or one in the second half (a loop runs to the end and would be diluted
    by a long good start in the whole output's share). The second half's n-grams are those of the
    whole that start there, so each size's are made once."""
    if _longest_run(tokens) >= TOKEN_RUN:
        return True
    half = len(tokens) // 2
    spans = [span for span in (len(tokens), len(tokens) - half) if span >= MIN_REPETITION_TOKENS]
    for n in NGRAM_SIZES if spans else ():
        grams = list(zip(*(tokens[i:] for i in range(n))))  # the n-grams, by start
        if any(_repeated_share(grams[len(tokens) - span:]) >= REPEATED_NGRAM_SHARE for span in spans):
            return True
    return False


def _density(lang: str) -> float:
    return SCRIPT_DENSITY.get(lang.rpartition("_")[2], 1.0)


def _length_ratio(source: str, output: str, src_lang: str, tgt_lang: str) -> bool:
    src_chars, out_chars = len(source.strip()), len(output.strip())
    if src_chars < MIN_LENGTH_SOURCE_CHARS:
        return False
    ratio = out_chars / src_chars * _density(src_lang) / _density(tgt_lang)
    low, high = LENGTH_BAND
    return not low <= ratio <= high


def _off_target(output: str, tgt_lang: str) -> bool:
    counts = script_counts(output)
    letters = sum(counts.values())
    if letters < MIN_SCRIPT_LETTERS:
        return False
    if script_share(counts, tgt_lang.rpartition("_")[2]) < MIN_TARGET_SCRIPT_SHARE:
        return True
    if letters < MIN_IDENTIFY_LETTERS or not covers(tgt_lang):
        return False
    found = detect(output, threshold=OFF_TARGET_CONFIDENCE)
    if found.lang is None or found.lang == tgt_lang:
        return False
    tgt_score = next((p for code, p in found.guesses if code == tgt_lang), 0.0)
    return tgt_score < TARGET_GUESS_FLOOR


def output_warnings(source: str, output: str, out_tokens: Sequence[int], src_lang: str, tgt_lang: str,
                    truncated: bool) -> list[str]:
    """The warning codes (in WARNING_CODES order) for one translation; [] when none.
    out_tokens: the generated ids after the target-language token, without </s>; src_lang: the
    given or detected FLORES code. The length ratio is in characters, which `SCRIPT_DENSITY` makes
    comparable across scripts."""
    found = {
        "repetition": _repetition(out_tokens),
        "length_ratio": _length_ratio(source, output, src_lang, tgt_lang),
        "off_target": _off_target(output, tgt_lang),
        "truncated": truncated,
    }
    return [code for code in WARNING_CODES if found[code]]


def translation_warnings(source: str, src_lang: str, tgt_lang: str, translation: Translation) -> list[str]:
    """output_warnings of a Translation of `source` (the given or detected FLORES src_lang): what the engine gives
    each text's translation, and what a caller that submitted with check_outputs=False makes itself."""
    return output_warnings(source, translation.text, translation.tokens, src_lang, tgt_lang, translation.truncated)
