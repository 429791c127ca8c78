"""The prefill graph's padded pack (engine/graphs.py padded_pack): every pack fits its bucket's sequence slots,
its sources keep their offsets, and the fillers form short sequences of their own (no GPU needed)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from engine.graphs import FILLER_RUN, SEQ_SLOTS_PER, EncoderGraphs, padded_pack

PADDING = np.array([1, 0, 999, 0], dtype=np.int64)[:, None]


def bucket(size: int) -> int:
    return 1 << max(size - 1, 31).bit_length()  # the graphs' buckets: powers of two from 32


@pytest.mark.parametrize("seed", range(40))
def test_a_pack_fits_its_buckets_sequence_slots_and_keeps_its_sources(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([1, 2, 3, rng.randint(1, 40), rng.randint(1, 200)]) for _ in range(rng.randint(1, 300))]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(cu[-1])
    tokens = np.arange(4 * n, dtype=np.int64).reshape(4, n)
    b = bucket(EncoderGraphs.pack_size(n, len(lengths)))
    host = padded_pack(b, tokens, cu, PADDING)
    slots = b // SEQ_SLOTS_PER
    assert host.size == 4 * b + slots + 1
    packed, offsets = host[:4 * b].reshape(4, b), host[4 * b:]
    assert (packed[:, :n] == tokens).all() and (packed[:, n:] == PADDING).all()
    assert (offsets[:len(cu)] == cu).all() and offsets[-1] == b
    fillers = np.diff(offsets[len(cu) - 1:])
    assert (fillers >= 0).all() and (fillers <= FILLER_RUN).all()


def test_many_one_token_sources_take_a_larger_bucket_than_their_tokens():
    assert EncoderGraphs.pack_size(40, 40) == 16 * 41  # one sequence slot for 8 tokens of the bucket
    assert EncoderGraphs.pack_size(1400, 54) == 1400  # sources of ~26 tokens: their tokens decide
