"""NLLB tokenizer: sentencepiece plus the fairseq id mapping, without transformers.

Token ids (the model's vocabulary):

    0 <s>   1 <pad>   2 </s>   3 <unk>
    spm piece id p >= 3          -> p + 1          (spm's own <unk> 0 -> 3; spm 1/2 are unused)
    language code i (of 202)     -> n_pieces + 1 + i
    <mask>                       -> n_pieces + 1 + 202
    vocab_size                   =  n_pieces + 1 + 202 + 1

A source is `[src_lang] pieces </s>` (HF's current, non-legacy behaviour). The decoder starts
with `</s>` then the forced target-language token; both are dropped again by `decode`.

A Tokenizer holds no mutable state after `load`; sentencepiece processors encode and decode
concurrently, so one instance may be shared by several threads.
"""
from __future__ import annotations

import bisect
import itertools
import os
import pathlib
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from typing import Sequence

import numpy as np
import sentencepiece as spm

from engine.errors import CheckpointError, InvalidRequest
from engine.languages import FLORES_CODES, check_language, language_index

SPM_FILE = "sentencepiece.bpe.model"

BOS_ID = 0
PAD_ID = 1
EOS_ID = 2
UNK_ID = 3
_FAIRSEQ_OFFSET = 1  # spm piece p (>= 3) -> p + 1
FIRST_PIECE_ID = 4  # the first token id that stands for a piece (spm's piece 3)
# decode_many's sentencepiece batch call costs ~40-80 us before its first sequence; below this many sequences a
# call each is cheaper (~3 us for 20 tokens on the 2-core machine)
DECODE_BATCH_MIN = 32
# sentencepiece lets go of the GIL while it decodes, so threads of ours share a large block (its own num_threads
# did not: 1,024 outputs of 63 tokens took 3.1 ms in one call and 2.9 with two of its threads, 1.7 in two calls on
# two of ours, on the 2-core machine); each takes at least DECODE_CHUNK_MIN sequences
DECODE_THREADS = min(8, os.cpu_count() or 1)
DECODE_CHUNK_MIN = 128


class Tokenizer:
    """sentencepiece + fairseq mapping + the 202 FLORES-200 language codes (see module doc)."""

    bos_id = BOS_ID
    pad_id = PAD_ID
    eos_id = EOS_ID
    unk_id = UNK_ID

    def __init__(self, processor: spm.SentencePieceProcessor, path: pathlib.Path | None = None):
        self._sp = processor
        self.path = path
        self.n_pieces: int = processor.get_piece_size()
        self.lang_offset: int = self.n_pieces + _FAIRSEQ_OFFSET
        self.mask_id: int = self.lang_offset + len(FLORES_CODES)
        self.vocab_size: int = self.mask_id + 1
        # a piece that decodes to nothing (a control piece: spm's <s>, which no model id maps to), to pad and to
        # stand in for skipped ids in decode_many's block; None: decode_many decodes one sequence at a time
        self._blank_piece = next((p for p in (1, 2) if p < self.n_pieces and processor.is_control(p)), None)

    @classmethod
    def load(cls, model_dir: pathlib.Path | str) -> "Tokenizer":
        """Read `model_dir/sentencepiece.bpe.model`; CheckpointError naming the file if unusable."""
        path = pathlib.Path(model_dir) / SPM_FILE
        if not path.is_file():
            raise CheckpointError(
                f"{path}: missing; an NLLB model directory needs its sentencepiece model "
                f"({SPM_FILE}, shipped with every NLLB checkpoint): copy it beside config.json"
            )
        processor = spm.SentencePieceProcessor()
        try:
            ok = processor.Load(str(path))
        except Exception as exc:  # sentencepiece raises OSError/RuntimeError on a bad proto
            raise CheckpointError(
                f"{path}: not a readable sentencepiece model ({exc}); replace it with the "
                f"{SPM_FILE} of the checkpoint"
            ) from exc
        if ok is False or processor.get_piece_size() < 4:
            raise CheckpointError(
                f"{path}: not a usable sentencepiece model; replace it with the {SPM_FILE} "
                "of the checkpoint"
            )
        return cls(processor, path)

    # ---- language codes -------------------------------------------------------------------

    def lang_id(self, code: str, field: str = "lang") -> int:
        """Token id of a language code; UnknownLanguage (naming `field`) for a bad code."""
        return self.lang_offset + language_index(check_language(code, field))

    def lang_code(self, token_id: int) -> str | None:
        """The language code whose token id this is, else None."""
        i = int(token_id) - self.lang_offset
        if 0 <= i < len(FLORES_CODES):
            return FLORES_CODES[i]
        return None

    # ---- encode / decode ------------------------------------------------------------------

    def encode_pieces(self, text: str) -> list[int]:
        """Model ids of the text's pieces, no special tokens. InvalidRequest for text that UTF-8
        cannot encode (a lone surrogate, which JSON's \\u escapes can carry)."""
        try:
            pieces = self._sp.encode(text)
        except RuntimeError:  # sentencepiece's binding refuses a str it cannot make UTF-8
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidRequest(f"the text holds {text[exc.start]!r} at character {exc.start}, a lone "
                                     "surrogate that is not Unicode; send valid UTF-8 text") from None
            raise
        return [p + _FAIRSEQ_OFFSET if p >= 3 else UNK_ID for p in pieces]

    def encode_source(self, text: str, src_lang: str) -> list[int]:
        """`[src_lang] pieces </s>`: the encoder input for one text."""
        lang = self.lang_id(src_lang, "src_lang")
        return [lang, *self.encode_pieces(text), EOS_ID]

    def is_text_id(self, token_id: int | np.ndarray) -> bool | np.ndarray:
        """True for ids that stand for a sentencepiece piece (not special, language or mask); elementwise for an
        array of ids."""
        return (token_id >= FIRST_PIECE_ID) & (token_id < self.lang_offset)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of a token sequence (Python ints, as the searches hold them: an int() a token was most of the
        cost at 1,024 outputs of 64 tokens); special ids, language codes, <mask> and ids outside the
        vocabulary are skipped."""
        lang_offset = self.lang_offset
        return self._sp.decode([t - _FAIRSEQ_OFFSET for t in ids if FIRST_PIECE_ID <= t < lang_offset])

    def decode_batch(self, seqs: Sequence[Sequence[int]]) -> list[str]:
        """`decode` of each sequence (`decode_many`, waited for)."""
        texts = self.decode_many(seqs)
        return [texts.at(i) for i in range(len(seqs))]

    def decode_many(self, seqs: Sequence[Sequence[int]],
                    block: tuple[np.ndarray, np.ndarray] | None = None) -> "PendingTexts":
        """`decode` of each sequence, started. Below DECODE_BATCH_MIN sequences (one sentence's latency, a few
        segments finishing) made here, one call each; else in the decode threads, through sentencepiece's batch
        call over one block of pieces, ids `decode` skips and the padding made a blank piece, so that no token
        goes through Python, and a large block cut among DECODE_THREADS threads (1,024 outputs of 64 tokens, which
        a fixed batch finishes at once, took ~7 ms one at a time on the 2-core machine). sentencepiece lets go of
        the GIL, so the caller's Python runs on meanwhile.
        `block`: the sequences already as one (ids [n, L] model ids, each row's first lengths [n] its sequence),
        else made from them."""
        n = len(seqs)
        if n < DECODE_BATCH_MIN or self._blank_piece is None:
            return PendingTexts([0], [[self.decode(ids) for ids in seqs]])
        ids, lengths = block if block is not None else block_of(seqs)
        inside = np.arange(ids.shape[1]) < lengths[:, None]
        pieces = np.where(inside & self.is_text_id(ids), ids - _FAIRSEQ_OFFSET, self._blank_piece).astype(np.int32)
        chunks = np.array_split(pieces, max(1, min(DECODE_THREADS, n // DECODE_CHUNK_MIN)))
        starts = np.cumsum([0] + [len(c) for c in chunks[:-1]]).tolist()
        return PendingTexts(starts, [decode_pool().submit(self._sp.decode, c, num_threads=1) for c in chunks])

    def id_to_piece(self, token_id: int) -> str:
        """Printable name of a token id (for logs and debugging)."""
        t = int(token_id)
        if t in (BOS_ID, PAD_ID, EOS_ID, UNK_ID):
            return ("<s>", "<pad>", "</s>", "<unk>")[t]
        if self.is_text_id(t):
            return self._sp.id_to_piece(t - _FAIRSEQ_OFFSET)
        code = self.lang_code(t)
        if code is not None:
            return code
        if t == self.mask_id:
            return "<mask>"
        raise IndexError(f"token id {t} outside the vocabulary (0..{self.vocab_size - 1})")

    def __repr__(self) -> str:
        return f"Tokenizer({self.path}, n_pieces={self.n_pieces}, vocab_size={self.vocab_size})"


def block_of(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Sequences as one block: ids [n, longest] (zeros past each one) and lengths [n]."""
    n = len(seqs)
    lengths = np.fromiter(map(len, seqs), np.int64, n)
    block = np.zeros((n, max(int(lengths.max(initial=0)), 1)), dtype=np.int64)
    block[np.arange(block.shape[1]) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(seqs), np.int64, int(lengths.sum()))
    return block, lengths


class PendingTexts:
    """The texts of a block's rows (Tokenizer.decode_many), decoded in chunks of consecutive rows; `at(i)` waits
    for row i's chunk alone, so the caller makes the first chunk's answers while the others decode."""

    def __init__(self, starts: list[int], chunks: list[list[str] | Future]):
        self._starts = starts  # each chunk's first row
        self._chunks = chunks  # each chunk's texts, or the thread's future of them

    def at(self, i: int) -> str:
        c = bisect.bisect_right(self._starts, i) - 1
        chunk = self._chunks[c]
        if isinstance(chunk, Future):
            chunk = self._chunks[c] = chunk.result()
        return chunk[i - self._starts[c]]


@cache
def decode_pool() -> ThreadPoolExecutor:
    """The threads that decode Tokenizer.decode_many's large blocks (made at the first)."""
    return ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="nllb-decode")
