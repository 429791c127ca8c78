"""engine.tokenizer against plain sentencepiece plus the fairseq mapping of NLLB."""
from __future__ import annotations

import pathlib
import random
import threading

import numpy as np
import pytest
import sentencepiece as spm

from engine.errors import CheckpointError, UnknownLanguage
from engine.languages import FLORES_CODES, check_language
from engine.tokenizer import Tokenizer
from tests.fixtures.make_toy import sample_sentence

TOY = pathlib.Path(__file__).resolve().parents[2] / "engine" / "assets" / "toy"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(TOY)


@pytest.fixture(scope="module")
def sp() -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(TOY / "sentencepiece.bpe.model"))


def test_flores_codes_are_nllbs_202_in_order():
    assert len(FLORES_CODES) == 202 == len(set(FLORES_CODES))
    assert FLORES_CODES[:3] == ("ace_Arab", "ace_Latn", "acm_Arab")
    assert FLORES_CODES[-1] == "zul_Latn"
    assert FLORES_CODES.index("eng_Latn") == 46 and FLORES_CODES.index("fra_Latn") == 56


def test_special_ids_and_vocab_layout(tok, sp):
    n = sp.get_piece_size()
    assert (tok.bos_id, tok.pad_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.n_pieces == n
    assert tok.lang_id("ace_Arab") == n + 1
    assert tok.lang_id("zul_Latn") == n + 202
    assert tok.mask_id == n + 203
    assert tok.vocab_size == n + 1 + 202 + 1


def test_real_nllb_vocab_arithmetic_gives_eng_latn_256047():
    # the real spm has 256000 pieces: eng_Latn must land on NLLB's well-known id 256047
    assert 256000 + 1 + FLORES_CODES.index("eng_Latn") == 256047


def test_encode_pieces_is_sentencepiece_shifted_by_one(tok, sp):
    rng = random.Random(1)
    for _ in range(50):
        text = sample_sentence(rng)
        want = [p + 1 if p >= 3 else 3 for p in sp.encode(text)]
        assert tok.encode_pieces(text) == want


def test_encode_source_is_lang_pieces_eos(tok):
    ids = tok.encode_source("kamira tuno", "eng_Latn")
    assert ids[0] == tok.lang_id("eng_Latn")
    assert ids[-1] == tok.eos_id
    assert ids[1:-1] == tok.encode_pieces("kamira tuno")


def test_round_trip_decode(tok):
    rng = random.Random(2)
    for _ in range(50):
        text = sample_sentence(rng)
        assert tok.decode(tok.encode_source(text, "fra_Latn")) == text


def test_unknown_characters_map_to_unk_and_decode_drops_them(tok, sp):
    ids = tok.encode_pieces("ka 😀 mi")
    assert tok.unk_id in ids
    assert 0 in sp.encode("ka 😀 mi")
    assert "😀" not in tok.decode(ids)


def test_decode_skips_specials_lang_codes_mask_and_out_of_vocab(tok):
    pieces = tok.encode_pieces("kamira")
    noisy = [tok.eos_id, tok.lang_id("deu_Latn"), tok.bos_id, *pieces, tok.pad_id, tok.unk_id,
             tok.mask_id, tok.vocab_size, tok.vocab_size + 100, -1, tok.eos_id]
    assert tok.decode(noisy) == "kamira"
    assert tok.decode([]) == ""


@pytest.mark.parametrize("count", [3, 31, 32, 300])  # one call each, one block, and chunks on threads
def test_decode_batch_is_sentencepiece_of_each_sequences_text_pieces(tok, sp, count):
    rng = random.Random(count)
    noise = [tok.bos_id, tok.pad_id, tok.eos_id, tok.unk_id, tok.lang_id("deu_Latn"), tok.mask_id, tok.vocab_size]
    seqs = []
    for i in range(count):
        pieces = tok.encode_pieces(sample_sentence(rng))
        if i % 3 == 0:
            pieces.insert(rng.randrange(len(pieces) + 1), rng.choice(noise))
        seqs.append(pieces if i % 7 else [])
    want = [sp.decode([t - 1 for t in seq if 4 <= t < tok.lang_offset]) for seq in seqs]
    assert tok.decode_batch(seqs) == want
    assert tok.decode_batch([]) == []


@pytest.mark.parametrize("count", [1, 31, 32, 300, 1000])
def test_decode_many_of_a_block_is_decode_of_each_rows_first_length_ids_read_in_any_order(tok, count):
    """What a finished step hands over: rows of ids past their lengths (</s>, tokens of longer rows); the texts
    are asked for out of row order, so that a later chunk is waited for before an earlier one."""
    rng = np.random.default_rng(count)
    ids = rng.integers(0, tok.vocab_size + 3, size=(count, 40))
    lengths = rng.integers(0, 41, size=count)
    seqs = [ids[i, :lengths[i]].tolist() for i in range(count)]
    texts = tok.decode_many(seqs, (ids.astype(np.int32), lengths))
    order = rng.permutation(count).tolist()
    assert [texts.at(i) for i in order] == [tok.decode(seqs[i]) for i in order]


def test_lang_code_inverts_lang_id(tok):
    for code in FLORES_CODES:
        assert tok.lang_code(tok.lang_id(code)) == code
    assert tok.lang_code(tok.mask_id) is None
    assert tok.lang_code(5) is None


def test_unknown_language_names_field_code_and_close_matches(tok):
    with pytest.raises(UnknownLanguage) as err:
        tok.encode_source("ka", "eng_latn")
    msg = str(err.value)
    assert "src_lang" in msg and "'eng_latn'" in msg and "NLLB-200" in msg and "eng_Latn" in msg
    with pytest.raises(UnknownLanguage) as err:
        check_language("deu_Latm", "tgt_lang")
    assert "tgt_lang" in str(err.value) and "deu_Latn" in str(err.value)
    assert err.value.code == "unknown_language"
    assert check_language("fra_Latn", "tgt_lang") == "fra_Latn"


def test_load_missing_or_corrupt_file_raises_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="sentencepiece.bpe.model"):
        Tokenizer.load(tmp_path)
    (tmp_path / "sentencepiece.bpe.model").write_bytes(b"not a model")
    with pytest.raises(CheckpointError, match="sentencepiece.bpe.model"):
        Tokenizer.load(tmp_path)


def test_concurrent_use_from_threads_gives_same_ids(tok):
    rng = random.Random(3)
    texts = [sample_sentence(rng) for _ in range(200)]
    want = [tok.encode_source(t, "eng_Latn") for t in texts]
    got: dict[int, list] = {}

    def work(k: int) -> None:
        got[k] = [tok.encode_source(t, "eng_Latn") for t in texts]
        assert [tok.decode(ids) for ids in got[k]] == texts

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(v == want for v in got.values()) and len(got) == 4
