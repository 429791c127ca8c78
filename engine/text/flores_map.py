"""ISO 639 language codes (as language identifiers emit them) -> NLLB's FLORES-200 codes.

`ISO_TO_FLORES` names the NLLB code of every language that the identifier (py3langid, see
engine.text.langid) or the other identifiers compared in docs/language.md (fastText lid.176,
lingua) emit and NLLB translates. Codes whose NLLB code depends on the script of the text
are in `BY_SCRIPT`. A 3-letter ISO 639-3 code that is the language part of exactly one FLORES code
maps to it (`fra` -> `fra_Latn`); macrolanguage codes map to the variety NLLB has (`ara` ->
`arb_Arab`, `fas` -> `pes_Arab`, `msa` -> `zsm_Latn`, `nor` -> `nob_Latn` ...).

Choices that are not obvious:
- `sr` is Serbian in either script; NLLB has Serbian only as srp_Cyrl, so Latin-script Serbian
  is srp_Cyrl too (NLLB's encoder reads Latin Serbian through the pieces it shares with
  hrv_Latn/bos_Latn). `sh` (Serbo-Croatian, undecided) is srp_Cyrl in Cyrillic, hrv_Latn in Latin.
- `als` is Alemannic in fastText's labels (Wikipedia's code), not Tosk Albanian: not NLLB.
  Albanian is `sq` -> als_Latn.
- `bh` is the Bhojpuri Wikipedia's code -> bho_Deva; `qu` -> quy_Latn (NLLB's only Quechua);
  `mg` -> plt_Latn; `mn` -> khk_Cyrl; `uz` -> uzn_Latn; `ku` -> kmr_Latn (ckb_Arab in Arabic
  script); `az` -> azj_Latn (azb_Arab in Arabic script).
"""
from __future__ import annotations

from engine.languages import FLORES_CODES
from engine.text.scripts import dominant_script, han_variant

ISO_TO_FLORES: dict[str, str | None] = {
    "als": None,  # Alemannic in fastText (a Wikipedia code); ISO 639-3 would be Tosk Albanian
    "af": "afr_Latn", "am": "amh_Ethi", "ar": "arb_Arab", "arz": "arz_Arab", "ary": "ary_Arab",
    "as": "asm_Beng", "ast": "ast_Latn", "ba": "bak_Cyrl", "be": "bel_Cyrl", "bg": "bul_Cyrl",
    "bh": "bho_Deva", "bm": "bam_Latn", "bn": "ben_Beng", "bo": "bod_Tibt", "bs": "bos_Latn",
    "ca": "cat_Latn", "ceb": "ceb_Latn", "ckb": "ckb_Arab", "crh": "crh_Latn", "cs": "ces_Latn",
    "cy": "cym_Latn", "da": "dan_Latn", "de": "deu_Latn", "dz": "dzo_Tibt", "ee": "ewe_Latn",
    "el": "ell_Grek", "en": "eng_Latn", "eo": "epo_Latn", "es": "spa_Latn", "et": "est_Latn",
    "eu": "eus_Latn", "fa": "pes_Arab", "fi": "fin_Latn", "fj": "fij_Latn", "fo": "fao_Latn",
    "fr": "fra_Latn", "fuv": "fuv_Latn", "ga": "gle_Latn", "gd": "gla_Latn", "gl": "glg_Latn",
    "gn": "grn_Latn", "gu": "guj_Gujr", "gug": "grn_Latn", "ha": "hau_Latn", "he": "heb_Hebr", "hi": "hin_Deva",
    "hr": "hrv_Latn", "ht": "hat_Latn", "hu": "hun_Latn", "hy": "hye_Armn", "id": "ind_Latn",
    "ig": "ibo_Latn", "ilo": "ilo_Latn", "is": "isl_Latn", "it": "ita_Latn", "ja": "jpn_Jpan",
    "jv": "jav_Latn", "ka": "kat_Geor", "kab": "kab_Latn", "kg": "kon_Latn", "ki": "kik_Latn",
    "kik": "kik_Latn", "kk": "kaz_Cyrl", "km": "khm_Khmr", "kn": "kan_Knda", "ko": "kor_Hang",
    "ky": "kir_Cyrl", "lb": "ltz_Latn", "lg": "lug_Latn", "li": "lim_Latn",
    "lij": "lij_Latn", "lmo": "lmo_Latn", "ln": "lin_Latn", "lo": "lao_Laoo", "lt": "lit_Latn",
    "ltg": "ltg_Latn", "lv": "lvs_Latn", "mai": "mai_Deva", "mg": "plt_Latn", "mi": "mri_Latn",
    "min": "min_Latn", "mk": "mkd_Cyrl", "ml": "mal_Mlym", "mn": "khk_Cyrl", "mr": "mar_Deva",
    "ms": "zsm_Latn", "mt": "mlt_Latn", "my": "mya_Mymr", "nb": "nob_Latn", "ne": "npi_Deva",
    "nl": "nld_Latn", "nn": "nno_Latn", "no": "nob_Latn", "nso": "nso_Latn", "ny": "nya_Latn",
    "oc": "oci_Latn", "om": "gaz_Latn", "or": "ory_Orya", "pa": "pan_Guru", "pl": "pol_Latn",
    "ps": "pbt_Arab", "pt": "por_Latn", "qu": "quy_Latn", "rn": "run_Latn", "ro": "ron_Latn",
    "ru": "rus_Cyrl", "rw": "kin_Latn", "sa": "san_Deva", "sc": "srd_Latn", "scn": "scn_Latn",
    "sd": "snd_Arab", "sg": "sag_Latn", "si": "sin_Sinh", "sk": "slk_Latn", "sl": "slv_Latn",
    "sm": "smo_Latn", "sn": "sna_Latn", "so": "som_Latn", "sq": "als_Latn", "sr": "srp_Cyrl",
    "ss": "ssw_Latn", "st": "sot_Latn", "su": "sun_Latn", "sv": "swe_Latn", "sw": "swh_Latn",
    "ta": "tam_Taml", "te": "tel_Telu", "tg": "tgk_Cyrl", "th": "tha_Thai", "ti": "tir_Ethi",
    "tk": "tuk_Latn", "tl": "tgl_Latn", "tn": "tsn_Latn", "tr": "tur_Latn", "ts": "tso_Latn",
    "tt": "tat_Cyrl", "tw": "twi_Latn", "ug": "uig_Arab", "uk": "ukr_Cyrl", "ur": "urd_Arab",
    "uz": "uzn_Latn", "vec": "vec_Latn", "vi": "vie_Latn", "war": "war_Latn", "wo": "wol_Latn",
    "xh": "xho_Latn", "yi": "ydd_Hebr", "yo": "yor_Latn", "yue": "yue_Hant", "zu": "zul_Latn",
    # ISO 639-3 macrolanguages: the variety NLLB has
    "ara": "arb_Arab", "fas": "pes_Arab", "msa": "zsm_Latn", "nor": "nob_Latn", "sqi": "als_Latn",
    "swa": "swh_Latn", "lav": "lvs_Latn", "mon": "khk_Cyrl", "aze": "azj_Latn", "est": "est_Latn",
    "uzb": "uzn_Latn", "kur": "kmr_Latn", "pus": "pbt_Arab", "orm": "gaz_Latn", "mlg": "plt_Latn",
    "nep": "npi_Deva", "que": "quy_Latn", "yid": "ydd_Hebr", "kau": "knc_Latn", "tmh": "taq_Latn",
}

# ISO code -> {script of the text: FLORES code}, and the code for any other script.
BY_SCRIPT: dict[str, tuple[dict[str, str], str]] = {
    "zh": ({"Hans": "zho_Hans", "Hant": "zho_Hant"}, "zho_Hans"),
    "zho": ({"Hans": "zho_Hans", "Hant": "zho_Hant"}, "zho_Hans"),
    "az": ({"Arab": "azb_Arab"}, "azj_Latn"),
    "ku": ({"Arab": "ckb_Arab"}, "kmr_Latn"),
    "sh": ({"Cyrl": "srp_Cyrl"}, "hrv_Latn"),
    "ks": ({"Deva": "kas_Deva"}, "kas_Arab"),
}

# 3-letter language part -> its FLORES codes (several where NLLB has the language in two scripts)
_BY_PREFIX: dict[str, list[str]] = {}
for _code in FLORES_CODES:
    _BY_PREFIX.setdefault(_code[:3], []).append(_code)


def _script_of(text: str) -> str | None:
    script = dominant_script(text)
    if script == "Jpan":  # kana in a Chinese text: decide by its Han characters
        return han_variant(text)
    return script


def to_flores(iso: str, text: str) -> str | None:
    """The FLORES-200 code NLLB uses for ISO 639 code `iso` (639-1, or 639-3 as identifiers emit
    them), the script read from `text` where it decides; None for a language NLLB lacks."""
    iso = iso.lower()
    if iso in BY_SCRIPT:
        table, default = BY_SCRIPT[iso]
        return table.get(_script_of(text) or "", default)
    if iso in ISO_TO_FLORES:
        return ISO_TO_FLORES[iso]
    candidates = _BY_PREFIX.get(iso, [])
    if len(candidates) == 1:
        return candidates[0]
    if candidates:  # NLLB has it in several scripts (ace, bjn, kas, knc, taq): the text's
        script = _script_of(text)
        return next((c for c in candidates if c.endswith(script or "")), candidates[0])
    return None


def flores_candidates(iso: str) -> frozenset[str]:
    """Every FLORES-200 code `to_flores(iso, text)` can give, whatever the text's script."""
    iso = iso.lower()
    if iso in BY_SCRIPT:
        table, default = BY_SCRIPT[iso]
        return frozenset([*table.values(), default])
    if iso in ISO_TO_FLORES:
        code = ISO_TO_FLORES[iso]
        return frozenset([code] if code else [])
    return frozenset(_BY_PREFIX.get(iso, []))
