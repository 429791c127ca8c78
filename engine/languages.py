"""The 202 FLORES-200 language codes of NLLB-200, in NLLB's own order.

The order is the model's: language code number i is token id `n_pieces + 1 + i` (see
`engine.tokenizer`). It is the `FAIRSEQ_LANGUAGE_CODES` list of HF transformers'
`tokenization_nllb.py`, written out here as data so the product never imports transformers.
"""
from __future__ import annotations

import difflib

from engine.errors import UnknownLanguage

AUTO = "auto"  # src_lang: identify the language (per text; once for a document)

FLORES_CODES: tuple[str, ...] = (
    "ace_Arab", "ace_Latn", "acm_Arab", "acq_Arab", "aeb_Arab", "afr_Latn", "ajp_Arab", "aka_Latn",
    "amh_Ethi", "apc_Arab", "arb_Arab", "ars_Arab", "ary_Arab", "arz_Arab", "asm_Beng", "ast_Latn",
    "awa_Deva", "ayr_Latn", "azb_Arab", "azj_Latn", "bak_Cyrl", "bam_Latn", "ban_Latn", "bel_Cyrl",
    "bem_Latn", "ben_Beng", "bho_Deva", "bjn_Arab", "bjn_Latn", "bod_Tibt", "bos_Latn", "bug_Latn",
    "bul_Cyrl", "cat_Latn", "ceb_Latn", "ces_Latn", "cjk_Latn", "ckb_Arab", "crh_Latn", "cym_Latn",
    "dan_Latn", "deu_Latn", "dik_Latn", "dyu_Latn", "dzo_Tibt", "ell_Grek", "eng_Latn", "epo_Latn",
    "est_Latn", "eus_Latn", "ewe_Latn", "fao_Latn", "pes_Arab", "fij_Latn", "fin_Latn", "fon_Latn",
    "fra_Latn", "fur_Latn", "fuv_Latn", "gla_Latn", "gle_Latn", "glg_Latn", "grn_Latn", "guj_Gujr",
    "hat_Latn", "hau_Latn", "heb_Hebr", "hin_Deva", "hne_Deva", "hrv_Latn", "hun_Latn", "hye_Armn",
    "ibo_Latn", "ilo_Latn", "ind_Latn", "isl_Latn", "ita_Latn", "jav_Latn", "jpn_Jpan", "kab_Latn",
    "kac_Latn", "kam_Latn", "kan_Knda", "kas_Arab", "kas_Deva", "kat_Geor", "knc_Arab", "knc_Latn",
    "kaz_Cyrl", "kbp_Latn", "kea_Latn", "khm_Khmr", "kik_Latn", "kin_Latn", "kir_Cyrl", "kmb_Latn",
    "kon_Latn", "kor_Hang", "kmr_Latn", "lao_Laoo", "lvs_Latn", "lij_Latn", "lim_Latn", "lin_Latn",
    "lit_Latn", "lmo_Latn", "ltg_Latn", "ltz_Latn", "lua_Latn", "lug_Latn", "luo_Latn", "lus_Latn",
    "mag_Deva", "mai_Deva", "mal_Mlym", "mar_Deva", "min_Latn", "mkd_Cyrl", "plt_Latn", "mlt_Latn",
    "mni_Beng", "khk_Cyrl", "mos_Latn", "mri_Latn", "zsm_Latn", "mya_Mymr", "nld_Latn", "nno_Latn",
    "nob_Latn", "npi_Deva", "nso_Latn", "nus_Latn", "nya_Latn", "oci_Latn", "gaz_Latn", "ory_Orya",
    "pag_Latn", "pan_Guru", "pap_Latn", "pol_Latn", "por_Latn", "prs_Arab", "pbt_Arab", "quy_Latn",
    "ron_Latn", "run_Latn", "rus_Cyrl", "sag_Latn", "san_Deva", "sat_Beng", "scn_Latn", "shn_Mymr",
    "sin_Sinh", "slk_Latn", "slv_Latn", "smo_Latn", "sna_Latn", "snd_Arab", "som_Latn", "sot_Latn",
    "spa_Latn", "als_Latn", "srd_Latn", "srp_Cyrl", "ssw_Latn", "sun_Latn", "swe_Latn", "swh_Latn",
    "szl_Latn", "tam_Taml", "tat_Cyrl", "tel_Telu", "tgk_Cyrl", "tgl_Latn", "tha_Thai", "tir_Ethi",
    "taq_Latn", "taq_Tfng", "tpi_Latn", "tsn_Latn", "tso_Latn", "tuk_Latn", "tum_Latn", "tur_Latn",
    "twi_Latn", "tzm_Tfng", "uig_Arab", "ukr_Cyrl", "umb_Latn", "urd_Arab", "uzn_Latn", "vec_Latn",
    "vie_Latn", "war_Latn", "wol_Latn", "xho_Latn", "ydd_Hebr", "yor_Latn", "yue_Hant", "zho_Hans",
    "zho_Hant", "zul_Latn",
)

_INDEX: dict[str, int] = {code: i for i, code in enumerate(FLORES_CODES)}
_LOWER: dict[str, str] = {code.lower(): code for code in FLORES_CODES}

assert len(FLORES_CODES) == 202 and len(_INDEX) == 202


def language_index(code: str) -> int:
    """Position of a valid code in FLORES_CODES (KeyError for an unknown code)."""
    return _INDEX[code]


def close_matches(code: str, n: int = 3) -> list[str]:
    """Up to `n` NLLB-200 codes that look like `code`, compared case-insensitively."""
    if not isinstance(code, str):
        return []
    lowered = code.lower()
    exact = _LOWER.get(lowered)
    found = difflib.get_close_matches(lowered, list(_LOWER), n=n, cutoff=0.6)
    out = [_LOWER[m] for m in found]
    if not out and len(lowered) >= 2:  # 'fr' -> 'fra_Latn': a prefix of the language part
        out = [c for low, c in _LOWER.items() if low.startswith(lowered)]
    if exact is not None and exact in out:
        out.remove(exact)
    if exact is not None:
        out.insert(0, exact)
    return out[:n]


def check_language(code: str, field: str) -> str:
    """Return `code` if it is an NLLB-200 language code, else raise UnknownLanguage.

    The message names the request field, the bad code, and up to 3 close matches.
    """
    if isinstance(code, str) and code in _INDEX:
        return code
    matches = close_matches(code)
    msg = f"{field}: {code!r} is not an NLLB-200 language code (FLORES-200 style, e.g. 'eng_Latn')"
    if matches:
        msg += "; did you mean " + ", ".join(repr(m) for m in matches) + "?"
    else:
        msg += "; see engine.languages.FLORES_CODES for the 202 supported codes"
    raise UnknownLanguage(msg)
