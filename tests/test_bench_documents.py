"""bench/documents.py: the bench's document is what its row says (2,000 distinct toy-word sentences of 15-30 words,
with line breaks and blank lines), the engine's segmentation gives back exactly those sentences (so the document and
the separate jobs translate the same sentences), and every word is a piece of the toy model."""
from __future__ import annotations

from bench import documents
from engine import TOY_MODEL_DIR
from engine.text.segment import split_document
from engine.tokenizer import Tokenizer


def test_document_is_seeded_distinct_sentences_of_toy_words():
    words = documents.toy_words(TOY_MODEL_DIR)
    doc, sentences = documents.make_document(words, documents.SENTENCES)
    assert (doc, sentences) == documents.make_document(words, documents.SENTENCES)
    assert len(sentences) == len(set(sentences)) == 2000
    assert all(15 <= len(s.split()) <= 30 and s[0].isupper() and s.endswith(".") for s in sentences)
    assert "\n\n" in doc and doc.count("\n") > 200 and "  " not in doc
    tok = Tokenizer.load(TOY_MODEL_DIR)
    assert all(tok.unk_id not in tok.encode_pieces(w) and len(tok.encode_pieces(w)) == 1 for w in words)


def test_segmentation_gives_back_the_sentences():
    doc, sentences = documents.make_document(documents.toy_words(TOY_MODEL_DIR), documents.SENTENCES, seed=3)
    layout = split_document(doc, documents.SRC)
    assert list(layout.sentences) == sentences
    assert set(layout.gaps[1:-1]) == {" ", "\n", "\n\n"}
