"""Sentence boundaries inside one line of text, per source language.

The boundaries come from sentencex (Wikimedia's rule-based segmenter, a Rust extension with no
model file): abbreviations, numbers, initials, quotes, ellipses and the sentence terminators of
every script Unicode gives one (. ! ? 。 ！ ？ । ॥ ؟ ۔ ։ ። ፧ ။ ...). `SENTENCEX_CODES` maps each
FLORES-200 code to the code sentencex knows the language by (MediaWiki's); sentencex then uses
the language's own rules, or those of the language MediaWiki falls back to (ast -> es, awa -> hi,
...), or its default rules. docs/segmentation.md lists which NLLB language gets which.

Rules of ours on top, for what sentencex leaves whole or splits wrongly (script-based, so they
hold for an unknown language too):
- Khmer ។ ៕ and Tibetan ། ༎ followed by a space end a sentence (sentencex lacks them).
- Thai and Lao write no sentence punctuation: a space between two letters of the script ends a
  sentence (spaces next to digits or other scripts, as in "ราคา 100 บาท", do not).
- A leading bullet ("• ", "- ", "* ") is hidden from sentencex, which otherwise leaves the whole
  line unsplit; a piece without any letter ("1.", ":)", "...") joins its neighbour, so that a list
  number stays with its item.
"""
from __future__ import annotations

import re

import sentencex

# FLORES-200 code -> sentencex (MediaWiki) language code.
SENTENCEX_CODES: dict[str, str] = {
    "ace_Arab": "ace", "ace_Latn": "ace", "acm_Arab": "acm", "acq_Arab": "ar", "aeb_Arab": "aeb-arab",
    "afr_Latn": "af", "ajp_Arab": "ar", "aka_Latn": "ak", "amh_Ethi": "am", "apc_Arab": "apc",
    "arb_Arab": "ar", "ars_Arab": "ar", "ary_Arab": "ary", "arz_Arab": "arz", "asm_Beng": "as",
    "ast_Latn": "ast", "awa_Deva": "awa", "ayr_Latn": "ay", "azb_Arab": "azb", "azj_Latn": "az",
    "bak_Cyrl": "ba", "bam_Latn": "bm", "ban_Latn": "ban", "bel_Cyrl": "be", "bem_Latn": "bem",
    "ben_Beng": "bn", "bho_Deva": "bho", "bjn_Arab": "bjn", "bjn_Latn": "bjn", "bod_Tibt": "bo",
    "bos_Latn": "bs", "bug_Latn": "bug", "bul_Cyrl": "bg", "cat_Latn": "ca", "ceb_Latn": "ceb",
    "ces_Latn": "cs", "cjk_Latn": "cjk", "ckb_Arab": "ckb", "crh_Latn": "crh-latn", "cym_Latn": "cy",
    "dan_Latn": "da", "deu_Latn": "de", "dik_Latn": "din", "dyu_Latn": "dyu", "dzo_Tibt": "dz",
    "ell_Grek": "el", "eng_Latn": "en", "epo_Latn": "eo", "est_Latn": "et", "eus_Latn": "eu",
    "ewe_Latn": "ee", "fao_Latn": "fo", "pes_Arab": "fa", "fij_Latn": "fj", "fin_Latn": "fi",
    "fon_Latn": "fon", "fra_Latn": "fr", "fur_Latn": "fur", "fuv_Latn": "ff", "gla_Latn": "gd",
    "gle_Latn": "ga", "glg_Latn": "gl", "grn_Latn": "gn", "guj_Gujr": "gu", "hat_Latn": "ht",
    "hau_Latn": "ha", "heb_Hebr": "he", "hin_Deva": "hi", "hne_Deva": "hne", "hrv_Latn": "hr",
    "hun_Latn": "hu", "hye_Armn": "hy", "ibo_Latn": "ig", "ilo_Latn": "ilo", "ind_Latn": "id",
    "isl_Latn": "is", "ita_Latn": "it", "jav_Latn": "jv", "jpn_Jpan": "ja", "kab_Latn": "kab",
    "kac_Latn": "kac", "kam_Latn": "kam", "kan_Knda": "kn", "kas_Arab": "ks-arab", "kas_Deva": "ks-deva",
    "kat_Geor": "ka", "knc_Arab": "kr", "knc_Latn": "kr", "kaz_Cyrl": "kk", "kbp_Latn": "kbp",
    "kea_Latn": "kea", "khm_Khmr": "km", "kik_Latn": "ki", "kin_Latn": "rw", "kir_Cyrl": "ky",
    "kmb_Latn": "kmb", "kon_Latn": "kg", "kor_Hang": "ko", "kmr_Latn": "ku-latn", "lao_Laoo": "lo",
    "lvs_Latn": "lv", "lij_Latn": "lij", "lim_Latn": "li", "lin_Latn": "ln", "lit_Latn": "lt",
    "lmo_Latn": "lmo", "ltg_Latn": "ltg", "ltz_Latn": "lb", "lua_Latn": "lua", "lug_Latn": "lg",
    "luo_Latn": "luo", "lus_Latn": "lus", "mag_Deva": "mag", "mai_Deva": "mai", "mal_Mlym": "ml",
    "mar_Deva": "mr", "min_Latn": "min", "mkd_Cyrl": "mk", "plt_Latn": "mg", "mlt_Latn": "mt",
    "mni_Beng": "mni", "khk_Cyrl": "mn", "mos_Latn": "mos", "mri_Latn": "mi", "zsm_Latn": "ms",
    "mya_Mymr": "my", "nld_Latn": "nl", "nno_Latn": "nn", "nob_Latn": "nb", "npi_Deva": "ne",
    "nso_Latn": "nso", "nus_Latn": "nus", "nya_Latn": "ny", "oci_Latn": "oc", "gaz_Latn": "om",
    "ory_Orya": "or", "pag_Latn": "pag", "pan_Guru": "pa", "pap_Latn": "pap", "pol_Latn": "pl",
    "por_Latn": "pt", "prs_Arab": "fa", "pbt_Arab": "ps", "quy_Latn": "qu", "ron_Latn": "ro",
    "run_Latn": "rn", "rus_Cyrl": "ru", "sag_Latn": "sg", "san_Deva": "sa", "sat_Beng": "sat",
    "scn_Latn": "scn", "shn_Mymr": "shn", "sin_Sinh": "si", "slk_Latn": "sk", "slv_Latn": "sl",
    "smo_Latn": "sm", "sna_Latn": "sn", "snd_Arab": "sd", "som_Latn": "so", "sot_Latn": "st",
    "spa_Latn": "es", "als_Latn": "sq", "srd_Latn": "sc", "srp_Cyrl": "sr-ec", "ssw_Latn": "ss",
    "sun_Latn": "su", "swe_Latn": "sv", "swh_Latn": "sw", "szl_Latn": "szl", "tam_Taml": "ta",
    "tat_Cyrl": "tt-cyrl", "tel_Telu": "te", "tgk_Cyrl": "tg-cyrl", "tgl_Latn": "tl", "tha_Thai": "th",
    "tir_Ethi": "ti", "taq_Latn": "taq", "taq_Tfng": "taq", "tpi_Latn": "tpi", "tsn_Latn": "tn",
    "tso_Latn": "ts", "tuk_Latn": "tk", "tum_Latn": "tum", "tur_Latn": "tr", "twi_Latn": "tw",
    "tzm_Tfng": "tzm", "uig_Arab": "ug-arab", "ukr_Cyrl": "uk", "umb_Latn": "umb", "urd_Arab": "ur",
    "uzn_Latn": "uz", "vec_Latn": "vec", "vie_Latn": "vi", "war_Latn": "war", "wol_Latn": "wo",
    "xho_Latn": "xh", "ydd_Hebr": "yi", "yor_Latn": "yo", "yue_Hant": "yue", "zho_Hans": "zh-hans",
    "zho_Hant": "zh-hant", "zul_Latn": "zu",
}
# A code sentencex has neither rules nor a fallback for: it then applies its default rules (its
# English abbreviations, with the sentence terminators of every script).
NEUTRAL_CODE = "und"

_EXTRA_TERMINATOR = re.compile(r"[\u17d4\u17d5\u0f0d\u0f0e]+(?=\s)")  # Khmer ។ ៕, Tibetan ། ༎
# Thai/Lao letters and marks, without their digits (0E50-0E59, 0ED0-0ED9).
_THAI_LAO = "\u0e01-\u0e4f\u0e5a\u0e5b\u0e81-\u0ecf\u0edc-\u0edf"
_THAI_LAO_SPACE = re.compile(rf"(?<=[{_THAI_LAO}])\s+(?=[{_THAI_LAO}])")
_SURROGATE = re.compile("[\ud800-\udfff]")
_LETTER = re.compile(r"[^\W\d_]")
_BULLET = re.compile(r"[•◦▪▫‣⁃●○■□►▸▶➢➤✓✔✗✘※*·\-–—]+\s+")


def sentence_ends(text: str, lang: str | None) -> list[int]:
    """Offsets in `text` (a line, stripped) where one sentence ends and the next may begin,
    ascending, each in 1 .. len(text) - 1. The whitespace after an end belongs to no sentence;
    the caller strips it."""
    bullet = _BULLET.match(text)
    start = bullet.end() if bullet else 0
    code = SENTENCEX_CODES.get(lang or "", NEUTRAL_CODE)
    body = _SURROGATE.sub("\ufffd", text[start:])  # sentencex takes UTF-8 only; offsets stay the same
    ends = {start + b["end_index"] for b in sentencex.get_sentence_boundaries(code, body)}
    ends.update(m.end() for m in _EXTRA_TERMINATOR.finditer(text, start))
    ends.update(m.start() for m in _THAI_LAO_SPACE.finditer(text, start))
    cuts = sorted(e for e in ends if 0 < e < len(text))
    return _join_letterless(text, cuts)


def _join_letterless(text: str, cuts: list[int]) -> list[int]:
    """Drop the cuts around pieces with no letter: such a piece joins the next one (the last
    piece joins the previous one)."""
    kept: list[int] = []
    begin = 0
    for end in cuts:
        if _has_letter(text[begin:end]):
            kept.append(end)
            begin = end
    if kept and not _has_letter(text[kept[-1]:]):
        kept.pop()
    return kept


def _has_letter(piece: str) -> bool:
    return _LETTER.search(piece) is not None
