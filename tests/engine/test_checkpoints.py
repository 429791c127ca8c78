"""Loading real-shaped and broken checkpoints: every naming variant loads, every defect is named."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine, GenerationOptions
from engine.errors import CheckpointError
from engine.weights import convert_pytorch_bin
from bench.checkpoint import SHAPES, make_config, shape_name, write_random_checkpoint


def copy_toy(toy_dir, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(toy_dir, out)
    return out


def test_bench_names_a_checkpoint_by_the_shape_its_config_gives():
    for name in SHAPES:
        assert shape_name(make_config(name)) == name
    odd = make_config("600M") | {"decoder_layers": 6}
    assert shape_name(odd) == "d_model 1024, 12 + 6 layers, 16 heads, ffn 4096"


@pytest.mark.slow
def test_600m_shape_sharded_loads_and_translates_one_sentence_on_cpu(tmp_path):
    model_dir = tmp_path / "nllb-600m-random"
    write_random_checkpoint(model_dir, "600M", shards=3)
    assert (model_dir / "model.safetensors.index.json").exists()
    eng = Engine.load(model_dir, device="cpu", max_rows=2, max_source_tokens=64)
    try:
        assert (eng.cfg.d_model, eng.cfg.encoder_layers, eng.cfg.vocab_size) == (1024, 12, 256206)
        result = eng.translate(["rema sila to"], "eng_Latn", "fra_Latn", GenerationOptions(max_new_tokens=4))[0]
        assert len(result.tokens) <= 3 and result.src_tokens > 2
    finally:
        eng.close()


@pytest.mark.parametrize("variant", ["shared", "embed_tokens", "lm_head"])
def test_every_hf_naming_variant_loads_to_the_same_logits(tmp_path, variant):
    reference_dir, variant_dir = tmp_path / "ref", tmp_path / variant
    write_random_checkpoint(reference_dir, "tiny", seed=5, dtype=torch.float32)
    write_random_checkpoint(variant_dir, "tiny", seed=5, dtype=torch.float32, tied_variant=variant)
    engines = [Engine.load(d, device="cpu", max_rows=2) for d in (reference_dir, variant_dir)]
    try:
        opts = GenerationOptions(max_new_tokens=5)
        a, b = (e.translate(["rema sila"], "eng_Latn", "fra_Latn", opts)[0] for e in engines)
        assert a.tokens == b.tokens and a.score == pytest.approx(b.score, abs=1e-5)
    finally:
        for e in engines:
            e.close()


def test_convert_turns_pytorch_bin_into_safetensors_without_unpickling_code(toy_dir, tmp_path):
    model_dir = copy_toy(toy_dir, tmp_path)
    state = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    torch.save(state, model_dir / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="nllb-worker convert"):
        Engine.load(model_dir, device="cpu")
    convert_pytorch_bin(model_dir)
    eng = Engine.load(model_dir, device="cpu", max_rows=2)
    try:
        assert eng.translate(["rema sila"], "eng_Latn", "fra_Latn")[0].tokens
    finally:
        eng.close()


def test_convert_refuses_a_pickle_that_would_run_code(tmp_path):
    class Exploit:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"x": Exploit()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="could run code"):
        convert_pytorch_bin(tmp_path)


def edit_config(model_dir, **fields):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(fields)
    (model_dir / "config.json").write_text(json.dumps(cfg))


def drop_tensor(model_dir, name):
    state = load_file(model_dir / "model.safetensors")
    del state[name]
    save_file(state, model_dir / "model.safetensors")


@pytest.mark.parametrize("breakage, message", [
    (lambda d: (d / "model.safetensors").write_bytes(b"\x00garbage" * 10), "not a readable safetensors"),
    (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
    (lambda d: edit_config(d, model_type="bert"), "model_type='bert'"),
    (lambda d: edit_config(d, d_model=96), "shape"),
    (lambda d: drop_tensor(d, "model.decoder.layers.1.fc2.weight"), "decoder.layers.1.fc2.weight"),
    (lambda d: (d / "sentencepiece.bpe.model").write_bytes(b"junk"), "sentencepiece"),
    (lambda d: (d / "model.safetensors").unlink(), "model.safetensors"),
])
def test_broken_or_foreign_checkpoint_is_a_clear_error(toy_dir, tmp_path, breakage, message):
    model_dir = copy_toy(toy_dir, tmp_path)
    breakage(model_dir)
    with pytest.raises(CheckpointError, match=message):
        Engine.load(model_dir, device="cpu", max_rows=2)
