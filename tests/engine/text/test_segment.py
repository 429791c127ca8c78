"""Document segmentation: the layout identity, the sentences per language, long-sentence pieces."""
from __future__ import annotations

import random
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.engine import TOY_MODEL_DIR
from engine.languages import FLORES_CODES
from engine.text.boundaries import SENTENCEX_CODES
from engine.text.segment import SPACE, Layout, for_target, reassemble, split_document
from engine.tokenizer import Tokenizer

LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"

# (language, one line with "|" where a reader of the language ends each sentence)
HARD_CASES = [
    ("eng_Latn", "Dr. Smith met Mrs. Jones.| They talked."),
    ("eng_Latn", "Bring fruit, e.g. apples and pears.| Then leave."),
    ("eng_Latn", "Pi is about 3.14 here.| It costs $1,000.50 now."),
    ("eng_Latn", 'He wrote "I am done."| Then he slept.'),
    ("eng_Latn", 'She said "Stop!" and left.| Nobody followed.'),
    ("eng_Latn", "Wait... what happened?| I don't know!"),
    ("eng_Latn", "Visit https://example.com/a.b?x=1 today.| Mail info@example.org for help."),
    ("eng_Latn", "J. R. R. Tolkien wrote books.| He died in 1973."),
    ("eng_Latn", "The U.S. economy grew fast.| Prices rose."),
    ("eng_Latn", "1. Preheat the oven to 180 degrees."),
    ("eng_Latn", "• Point one.| Point two."),
    ("deu_Latn", "Das ist z. B. ein Test.| Er kam am 3. Mai an."),
    ("spa_Latn", "¿Qué hora es?| Son las tres.| ¡Vamos!"),
    ("rus_Cyrl", "Он живёт в г. Москве.| Это большой город."),
    ("ell_Grek", "Τι κάνεις;| Καλά είμαι."),
    ("zho_Hans", "你好。|今天天气很好！|你呢？"),
    ("jpn_Jpan", "こんにちは。|元気ですか？|はい！"),
    ("hin_Deva", "यह एक वाक्य है।| यह दूसरा है॥| तीसरा वाक्य।"),
    ("arb_Arab", "كيف حالك؟| أنا بخير."),
    ("urd_Arab", "یہ پہلا جملہ ہے۔| یہ دوسرا ہے۔"),
    ("hye_Armn", "Բարև։| Ինչպե՞ս ես։"),
    ("amh_Ethi", "ሰላም ነው።| እንዴት ነህ፧"),
    ("mya_Mymr", "မင်္ဂလာပါ။| နေကောင်းလား။"),
    ("khm_Khmr", "ខ្ញុំសុខសប្បាយ។| អ្នកសុខសប្បាយទេ?"),
    ("bod_Tibt", "ང་བོད་པ་ཡིན།| ཁྱེད་རང་གང་ནས་ཡིན།"),
    ("tha_Thai", "สวัสดีครับ| ผมชื่อสมชาย"),
    ("tha_Thai", "ราคา 100 บาท"),
]


@pytest.mark.parametrize(("lang", "marked"), HARD_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(HARD_CASES)])
def test_hard_cases_are_cut_where_a_reader_would(lang: str, marked: str) -> None:
    expected = [sentence.strip() for sentence in marked.split("|")]
    assert list(split_document(marked.replace("|", ""), lang).sentences) == expected


def test_every_nllb_language_has_a_sentencex_code() -> None:
    assert set(SENTENCEX_CODES) == set(FLORES_CODES)


def test_space_holds_every_unicode_whitespace_character() -> None:
    assert {chr(c) for c in range(0x110000) if chr(c).isspace()} <= set(SPACE)


@pytest.mark.parametrize("doc", ["", " ", "\n\n", "\r\n \t\u3000\u00a0\u2028 "])
def test_a_blank_document_has_no_sentence_and_one_gap(doc: str) -> None:
    assert split_document(doc, "eng_Latn") == Layout(gaps=(doc,), sentences=())


def test_a_line_break_always_ends_a_sentence() -> None:
    doc = "Dear Ms. Brown\nthank you for the letter of\n12 May\r\nand the photos"
    assert split_document(doc, "eng_Latn").sentences == (
        "Dear Ms. Brown", "thank you for the letter of", "12 May", "and the photos")


def test_an_unknown_language_gets_the_neutral_rules() -> None:
    for lang in (None, "xyz_Latn"):
        assert split_document("One here. Two there！三。", lang).sentences == ("One here.", "Two there！", "三。")


def test_lone_surrogates_are_cut_like_any_character() -> None:
    doc = "Bad \ud800 text. Next one."
    layout = split_document(doc, "eng_Latn")
    assert layout.sentences == ("Bad \ud800 text.", "Next one.") and reassemble(layout, layout.sentences) == doc


def test_reassemble_puts_translations_between_the_sources_whitespace() -> None:
    layout = split_document("\ufeff  Hello there. How are you?\r\n\r\n\tFine!\u3000 ", "eng_Latn")
    assert reassemble(layout, ["Bonjour.", "Ça va ?", "Bien !"]) == "\ufeff  Bonjour. Ça va ?\r\n\r\n\tBien !\u3000 "


def test_reassemble_refuses_a_wrong_number_of_translations() -> None:
    with pytest.raises(ValueError, match="2 translations for a layout of 3 sentences"):
        reassemble(split_document("It is. So be it. Go now.", "eng_Latn"), ["x", "y"])


# ---- property tests ----------------------------------------------------------------------------

# Sentences that are one sentence each, whatever follows them after a space or a line break.
POOL = ["The cat sat on the mat.", "Dr. Smith is here today.", "It costs 3.14 euros!", "Is it raining?",
        "Wait... what happened?", "Он пришёл домой.", "यह एक वाक्य है।", "你好。", "She said \"Go.\"",
        "1. Preheat the oven.", "No final stop"]
INLINE = ["\u0020", "  ", "\t", "\u3000", "\u2009 ", " \u00a0"]               # between sentences of a line
LINE_GAPS = ["\n", "\r\n", "\n\n", "\r\n\r\n", "\u2028", "\n   ", "  \n", "\n\t\t", "\n\u00a0\n", "\r"]
EDGES = ["", " ", "\n", "\r\n  ", "\ufeff", "\u3000", "\t\n\n"]


@st.composite
def documents(draw: st.DrawFn) -> tuple[str, list[str], list[str]]:
    """A document, and the sentences and gaps it was built from (the expected layout)."""
    sentences = draw(st.lists(st.sampled_from(POOL), max_size=12))
    gaps = [draw(st.sampled_from(EDGES))]
    if not sentences:
        return gaps[0], [], gaps
    for i in range(len(sentences) - 1):
        ends_line = sentences[i] == "No final stop" or sentences[i + 1].startswith("1.")
        gaps.append(draw(st.sampled_from(LINE_GAPS if ends_line else INLINE + LINE_GAPS)))
    gaps.append(draw(st.sampled_from(EDGES)))
    doc = "".join(g + s for g, s in zip(gaps, sentences)) + gaps[-1]
    return doc, sentences, gaps


@settings(max_examples=300, deadline=None)
@given(documents())
def test_documents_split_into_their_sentences_and_whitespace(built: tuple[str, list[str], list[str]]) -> None:
    doc, sentences, gaps = built
    layout = split_document(doc, "eng_Latn")
    assert layout == Layout(gaps=tuple(gaps), sentences=tuple(sentences))
    assert reassemble(layout, layout.sentences) == doc
    skeleton = "".join(gap + "x" for gap in gaps[:-1]) + gaps[-1]
    assert reassemble(layout, ["x"] * len(sentences)) == skeleton


ANY_CHARS = list("ab .!?,;。！？।\n\r\t") + ["\u00a0", "\u3000", "\u2028", "\ufeff", "ก", "\u0e31", "\u0301", "\ud800"]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(ANY_CHARS), max_size=80),
       st.sampled_from([None, "eng_Latn", "tha_Thai", "zho_Hans", "hin_Deva"]))
def test_any_text_keeps_the_layout_identity(doc: str, lang: str | None) -> None:
    layout = split_document(doc, lang, count_tokens=len, max_tokens=5)
    assert len(layout.gaps) == len(layout.sentences) + 1
    assert reassemble(layout, layout.sentences) == doc
    for sentence in layout.sentences:
        assert sentence and sentence.strip(SPACE) == sentence
        assert not set(sentence) & set(LINE_BREAKS)
    assert all(set(gap) <= set(SPACE) for gap in layout.gaps)


# ---- sentences over the token limit ------------------------------------------------------------

@pytest.fixture(scope="module")
def toy_count_tokens():
    tokenizer = Tokenizer.load(TOY_MODEL_DIR)
    return lambda text: len(tokenizer.encode_source(text, "eng_Latn"))


def _run_on_line(words: int, comma_every: int | None, seed: int = 0) -> str:
    rng = random.Random(seed)
    vocab = "the cat sat on a mat while dogs ran and birds sang near people walking home".split()
    out = []
    for i in range(words):
        out.append(rng.choice(vocab) + ("," if comma_every and i % comma_every == comma_every - 1 else ""))
    return " ".join(out) + "."


def test_a_3000_word_run_on_line_is_cut_at_commas_under_the_limit(toy_count_tokens) -> None:
    line = _run_on_line(3000, comma_every=7)  # a comma in the second half of every piece's room
    layout = split_document(line, "eng_Latn", toy_count_tokens, max_tokens=128)
    assert len(layout.sentences) > 10
    assert reassemble(layout, layout.sentences) == line
    assert all(toy_count_tokens(piece) <= 128 for piece in layout.sentences)
    assert all(piece.endswith(",") for piece in layout.sentences[:-1])
    assert set(layout.gaps[1:-1]) == {" "}


def test_a_run_on_line_without_punctuation_is_cut_between_words(toy_count_tokens) -> None:
    line = _run_on_line(3000, comma_every=None)[:-1]
    layout = split_document(line, "eng_Latn", toy_count_tokens, max_tokens=64)
    assert reassemble(layout, layout.sentences) == line
    assert all(toy_count_tokens(piece) <= 64 for piece in layout.sentences)
    assert [w for piece in layout.sentences for w in piece.split(" ")] == line.split(" ")


def test_a_run_without_spaces_is_cut_between_characters(toy_count_tokens) -> None:
    run = "".join(random.Random(1).choice("กขคงจฉชซ你好天气") for _ in range(5000))
    layout = split_document(run, "tha_Thai", toy_count_tokens, max_tokens=40)
    assert "".join(layout.sentences) == run and set(layout.gaps) == {""}
    assert all(toy_count_tokens(piece) <= 40 for piece in layout.sentences)


def test_clause_punctuation_wins_over_a_later_space_and_fullwidth_needs_no_space() -> None:
    layout = split_document("aaaa, bbbb cc dd", None, count_tokens=len, max_tokens=13)
    assert layout.sentences == ("aaaa, bbbb cc", "dd")  # the comma is in the first half of the room
    layout = split_document("aaaaaa, bbbb cc dd", None, count_tokens=len, max_tokens=13)
    assert layout.sentences == ("aaaaaa,", "bbbb cc dd")
    layout = split_document("今天天气很好，我们去公园吧", "zho_Hans", count_tokens=len, max_tokens=8)
    assert layout.sentences == ("今天天气很好，", "我们去公园吧")


def test_a_character_cut_keeps_combining_marks_with_their_letter() -> None:
    word = "e\u0301" * 20
    layout = split_document(word, None, count_tokens=len, max_tokens=5)
    assert "".join(layout.sentences) == word
    assert all(unicodedata.category(piece[0]) != "Mn" for piece in layout.sentences)


def test_a_limit_below_one_character_still_yields_every_character() -> None:
    layout = split_document("abc de", None, count_tokens=lambda s: len(s) + 2, max_tokens=2)
    assert layout.sentences == ("a", "b", "c", "d", "e") and layout.gaps == ("", "", "", " ", "", "")


def test_long_lines_cost_few_token_counts() -> None:
    calls = 0

    def count(text: str) -> int:
        nonlocal calls
        calls += 1
        return len(text) // 4

    line = _run_on_line(20_000, comma_every=None)[:100_000]
    layout = split_document(line, "eng_Latn", count, max_tokens=200)
    assert len(layout.sentences) > 100
    assert calls < 20 * len(layout.sentences)  # O(log n) counts a piece, not O(n)


def test_translations_of_chinese_sentences_get_a_space_where_the_target_writes_one():
    layout = split_document("今天天气很好。我又把钥匙忘在家里了。\n最近的火车站在哪里？", "zho_Hans")
    assert layout.gaps == ("", "", "\n", "")
    assert reassemble(for_target(layout, "eng_Latn"), ["Nice.", "Forgot.", "Where?"]) == "Nice. Forgot.\nWhere?"
    assert for_target(layout, "jpn_Jpan") == layout  # Japanese writes none either
    cut = split_document("a" * 50, "eng_Latn", len, 20)  # pieces cut inside a word keep their empty gaps
    assert for_target(cut, "fra_Latn") == cut
