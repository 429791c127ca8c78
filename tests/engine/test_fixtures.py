"""The committed toy checkpoint and the random-checkpoint generator, against HF transformers."""
from __future__ import annotations

import json
import pathlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine.tokenizer import Tokenizer  # noqa: E402
from tests.fixtures import make_toy  # noqa: E402
from bench.checkpoint import TIED_VARIANTS, write_random_checkpoint  # noqa: E402

TOY = pathlib.Path(__file__).resolve().parents[2] / "engine" / "assets" / "toy"


@pytest.fixture(scope="module")
def toy():
    model = transformers.M2M100ForConditionalGeneration.from_pretrained(TOY).eval()
    return Tokenizer.load(TOY), model


def _greedy(model, tok, text, src, tgt):
    ids = torch.tensor([tok.encode_source(text, src)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, forced_bos_token_id=tok.lang_id(tgt), num_beams=1,
                             do_sample=False, max_new_tokens=24)
    return out[0].tolist()


def test_toy_files_are_an_nllb_checkpoint():
    names = {p.name for p in TOY.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors",
            "sentencepiece.bpe.model", "README.md"} <= names
    cfg = json.loads((TOY / "config.json").read_text())
    assert cfg["model_type"] == "m2m_100" and cfg["scale_embedding"] is True
    assert cfg["vocab_size"] == Tokenizer.load(TOY).vocab_size
    gen = json.loads((TOY / "generation_config.json").read_text())
    assert (gen["max_length"], gen["decoder_start_token_id"], gen["eos_token_id"]) == (200, 2, 2)


def test_toy_copies_for_fra_reverses_for_deu_halves_for_spa(toy):
    tok, model = toy
    rng = make_toy.random.Random(99)  # in-distribution inputs: words of the toy's syllables
    for text, src in [("kamira tuno", "eng_Latn"), ("shabe dorqua xili", "deu_Latn"),
                      ("ki", "spa_Latn"), ("tramu gropli fel banso", "fra_Latn"),
                      (make_toy.sample_sentence(rng), "ita_Latn")]:
        pieces = tok.encode_pieces(text)
        for tgt, f in make_toy.TASKS.items():
            out = _greedy(model, tok, text, src, tgt)
            assert out == [2, tok.lang_id(tgt), *f(pieces), 2], (text, tgt)


def test_toy_greedy_exact_match_on_held_out_samples(toy):
    tok, model = toy
    examples = make_toy.make_dataset(tok, 90, seed=4242)
    acc = make_toy.greedy_accuracy(model, tok, examples)
    assert acc["fra_Latn"] >= 0.97 and acc["deu_Latn"] >= 0.95 and acc["spa_Latn"] >= 0.95, acc


def _logits(path):
    model, info = transformers.M2M100ForConditionalGeneration.from_pretrained(
        path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor([[256047, 100, 200, 2]]),
                            decoder_input_ids=torch.tensor([[2, 256057]])).logits


@pytest.fixture(scope="module")
def tiny_reference(tmp_path_factory):
    path = write_random_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", dtype=torch.float32)
    return _logits(path)


def test_random_tiny_checkpoint_loads_in_hf_with_finite_logits(tiny_reference):
    assert tiny_reference.shape == (1, 2, 256206)
    assert torch.isfinite(tiny_reference).all()


@pytest.mark.parametrize("tied_variant", TIED_VARIANTS)
@pytest.mark.parametrize("shards", [1, 3])
def test_random_tiny_checkpoint_tied_variants_and_shards_give_identical_logits(
        tmp_path, tiny_reference, tied_variant, shards):
    path = write_random_checkpoint(tmp_path, "tiny", dtype=torch.float32, shards=shards,
                                   tied_variant=tied_variant)
    if shards > 1:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"].values()) == {
            f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
        assert index["metadata"]["total_size"] == sum(
            (path / f).stat().st_size for f in set(index["weight_map"].values())) - sum(
            8 + int.from_bytes((path / f).read_bytes()[:8], "little")
            for f in set(index["weight_map"].values()))
    assert torch.equal(_logits(path), tiny_reference)


def test_random_checkpoint_fp16_config_matches_real_600m_fields(tmp_path):
    from bench.checkpoint import checkpoint_nbytes, make_config
    cfg = make_config("600M")
    assert (cfg["d_model"], cfg["encoder_layers"], cfg["decoder_layers"],
            cfg["encoder_ffn_dim"], cfg["encoder_attention_heads"]) == (1024, 12, 12, 4096, 16)
    assert cfg["vocab_size"] == 256206 and cfg["max_position_embeddings"] == 1024
    assert 1.2e9 < checkpoint_nbytes("600M") < 1.25e9
