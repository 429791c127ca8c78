"""bench/ct2.py: the checkpoint converted with the synthetic vocabulary decodes what HF `generate` decodes, token for
token (greedy, float32 on the CPU): on the tiny random NLLB shape the bench writes (its full vocabulary), and on the
trained toy model, whose output follows its source (so a wrong weight or id mapping shows), so that the bench's CT2
rows run the same model on the same ids as ours and HF's."""
from __future__ import annotations

import random

import pytest
import torch

from bench import ct2

pytestmark = pytest.mark.skipif(ct2.import_error() is not None, reason=f"ctranslate2: {ct2.import_error()}")


@pytest.fixture(scope="module", params=["tiny-random", "toy-trained"])
def checkpoint(request, tmp_path_factory):
    if request.param == "toy-trained":
        from engine import TOY_MODEL_DIR
        return TOY_MODEL_DIR
    from bench.checkpoint import write_random_checkpoint
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", dtype=torch.float32)


def test_synthetic_vocabulary_maps_ids_both_ways():
    ids = [0, 1, 2, 3, 4, 259, 256205]
    assert [ct2.token(i) for i in ids][:4] == ["<s>", "<pad>", "</s>", "<unk>"]
    assert [ct2.token_id(ct2.token(i)) for i in ids] == ids


def test_greedy_tokens_equal_hf_generate(checkpoint, tmp_path):
    from bench.workloads import hf_generate, load_hf
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.load(checkpoint)
    rng = random.Random(0)
    sources = [[tok.lang_id("eng_Latn")] + [rng.randrange(4, tok.n_pieces) for _ in range(n)] + [2]
               for n in (3, 7, 11, 16)]  # the toy learnt 1-16 pieces
    forced, new_tokens = tok.lang_id("fra_Latn"), 12
    hf = load_hf(checkpoint, "cpu", torch.float32)
    expected = hf_generate(hf, sources, forced, 1, new_tokens, "cpu")[:, 1:].tolist()  # drop the decoder start

    model = ct2.convert(checkpoint, tmp_path / "ct2", "float32")
    import ctranslate2
    peer = ct2.CT2(ctranslate2.Translator(str(model), device="cpu", compute_type="float32"))
    got = ct2.CT2.output_ids(peer.translate(ct2.CT2.sources(sources), forced, 1, new_tokens, max_batch_size=2))

    assert all(len(ids) == new_tokens and ids[0] == forced for ids in got)
    assert got == expected
    if checkpoint.name == "toy":  # trained (to copy its source): each source decodes to its own output
        assert len({tuple(ids) for ids in got}) == len(sources)
