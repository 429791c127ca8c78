"""Writing system of a text, in the ISO 15924 names FLORES-200 codes end with (Latn, Cyrl, Hans ...).

Pure and cheap: one pass over the characters, a binary search per letter in a table of Unicode
blocks. Han text is Hans or Hant by the characters that exist in only one of the two standards
(`SIMPLIFIED_ONLY` / `TRADITIONAL_ONLY`, pairs of the most frequent such characters); Han with
kana is Jpan. Digits, punctuation, spaces and symbols count for no script.
"""
from __future__ import annotations

import bisect
from collections import Counter

# (first code point, last code point, script), sorted by first; blocks with letters only.
_BLOCKS: tuple[tuple[int, int, str], ...] = (
    (0x0041, 0x005A, "Latn"), (0x0061, 0x007A, "Latn"), (0x00C0, 0x024F, "Latn"),
    (0x0370, 0x03FF, "Grek"), (0x0400, 0x052F, "Cyrl"), (0x0531, 0x058F, "Armn"),
    (0x0590, 0x05FF, "Hebr"), (0x0600, 0x06FF, "Arab"), (0x0750, 0x077F, "Arab"),
    (0x0900, 0x097F, "Deva"), (0x0980, 0x09FF, "Beng"), (0x0A00, 0x0A7F, "Guru"),
    (0x0A80, 0x0AFF, "Gujr"), (0x0B00, 0x0B7F, "Orya"), (0x0B80, 0x0BFF, "Taml"),
    (0x0C00, 0x0C7F, "Telu"), (0x0C80, 0x0CFF, "Knda"), (0x0D00, 0x0D7F, "Mlym"),
    (0x0D80, 0x0DFF, "Sinh"), (0x0E00, 0x0E7F, "Thai"), (0x0E80, 0x0EFF, "Laoo"),
    (0x0F00, 0x0FFF, "Tibt"), (0x1000, 0x109F, "Mymr"), (0x10A0, 0x10FF, "Geor"),
    (0x1100, 0x11FF, "Hang"), (0x1200, 0x139F, "Ethi"), (0x1780, 0x17FF, "Khmr"),
    (0x1C90, 0x1CBF, "Geor"), (0x1E00, 0x1EFF, "Latn"), (0x1F00, 0x1FFF, "Grek"),
    (0x2D30, 0x2D7F, "Tfng"), (0x2D80, 0x2DDF, "Ethi"), (0x3040, 0x30FF, "Kana"),
    (0x3130, 0x318F, "Hang"), (0x31F0, 0x31FF, "Kana"), (0x3400, 0x4DBF, "Hani"),
    (0x4E00, 0x9FFF, "Hani"), (0xA640, 0xA69F, "Cyrl"), (0xA720, 0xA7FF, "Latn"),
    (0xA980, 0xA9DF, "Java"), (0xAB00, 0xAB2F, "Ethi"), (0xAB30, 0xAB6F, "Latn"),
    (0xAC00, 0xD7AF, "Hang"), (0xF900, 0xFAFF, "Hani"), (0xFB1D, 0xFB4F, "Hebr"),
    (0xFB50, 0xFDFF, "Arab"), (0xFE70, 0xFEFF, "Arab"), (0xFF21, 0xFF3A, "Latn"),
    (0xFF41, 0xFF5A, "Latn"), (0xFF66, 0xFF9D, "Kana"), (0x20000, 0x2FA1F, "Hani"),
)
_STARTS = [b[0] for b in _BLOCKS]

# Frequent characters whose other form differs, each written in one standard only (pairs at the
# same positions; characters also used in the other standard, like 里 后 干 佣, are left out).
SIMPLIFIED_ONLY = frozenset(
    "这们个来时说会为国学对过发经现还实问动进长开关从东车门马见书间话样气觉总让请认识钱岁语电听"
    "买卖业两热爱欢乐写读钥给边远运题应该员达报场机农产无历华红绿鸟鱼龙风飞饭馆馈济图团园圆"
    "万与专丛丝严丧临丽举义乌乔习乡乱争亏亚亲亿仅众优伞伟传伤伦伪侠侣侥俭"
)
TRADITIONAL_ONLY = frozenset(
    "這們個來時說會為國學對過發經現還實問動進長開關從東車門馬見書間話樣氣覺總讓請認識錢歲語電聽"
    "買賣業兩熱愛歡樂寫讀鑰給邊遠運題應該員達報場機農產無歷華紅綠鳥魚龍風飛飯館饋濟圖團園圓"
    "萬與專叢絲嚴喪臨麗舉義烏喬習鄉亂爭虧亞親億僅眾優傘偉傳傷倫偽俠侶僥儉"
)

# Scripts one language may mix: Japanese is kana plus Han; Korean may carry Han (hanja).
_HAN_FAMILY = frozenset({"Hans", "Hant", "Jpan", "Hani", "Kana"})


def char_script(ch: str) -> str | None:
    """The script of one character (Hani for any Han character, Kana for kana), None for
    non-letters."""
    cp = ord(ch)
    i = bisect.bisect_right(_STARTS, cp) - 1
    if i >= 0 and cp <= _BLOCKS[i][1]:
        return _BLOCKS[i][2]
    return None


class _ScriptOf(dict):
    """char -> char_script(char), filled as characters are met: a text's characters are then looked up in
    C (`map` over `__getitem__`) instead of one Python call and a binary search each, which made the
    off_target warning cost most of its time on every output. Bounded: producers choose the characters."""

    LIMIT = 1 << 16

    def __missing__(self, ch: str) -> str | None:
        script = char_script(ch)
        if len(self) < self.LIMIT:
            self[ch] = script
        return script


_SCRIPT_OF = _ScriptOf()


def script_counts(text: str) -> Counter[str]:
    """Letters per script; Han characters counted as Hani, kana as Kana."""
    counts = Counter(map(_SCRIPT_OF.__getitem__, text))
    counts.pop(None, None)
    return counts


def han_variant(text: str) -> str:
    """Hant when the text has more traditional-only than simplified-only characters, else Hans
    (simplified is the default: most Chinese text online is simplified)."""
    trad = sum(ch in TRADITIONAL_ONLY for ch in text)
    simp = sum(ch in SIMPLIFIED_ONLY for ch in text)
    return "Hant" if trad > simp else "Hans"


def dominant_script(text: str) -> str | None:
    """The script of most of the text's letters as a FLORES suffix; None for a text without
    letters. Han with any kana is Jpan; Han alone is Hans or Hant (`han_variant`)."""
    counts = script_counts(text)
    if not counts:
        return None
    if counts["Kana"]:
        counts["Jpan"] = counts.pop("Kana") + counts.pop("Hani", 0)
    elif counts["Hani"]:
        counts[han_variant(text)] = counts.pop("Hani")
    return counts.most_common(1)[0][0]


def scripts_agree(found: str, expected: str) -> bool:
    """True when text in script `found` may be text of a language written in `expected`:
    equal, or both of the Han family (Japanese writes Han; Chinese text may hold kana)."""
    return found == expected or (found in _HAN_FAMILY and expected in _HAN_FAMILY)


def script_share(counts: Counter[str], expected: str) -> float:
    """Share of letters (`script_counts` of a text) that agree with script `expected` (0..1; 1.0 without
    letters)."""
    total = sum(counts.values())
    if total == 0:
        return 1.0
    agree = sum(n for s, n in counts.items() if scripts_agree(s, expected))
    return agree / total
