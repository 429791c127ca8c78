"""Checkpoints whose shapes some CUDA kernel cannot take load on the GPU and run those ops on their PyTorch reference
(Backend.for_model, kernels/support.py): in float32 the same tokens as the CPU path, with and without LoRA, and the
substitution logged once. Run with -m gpu."""
from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import TOY_MODEL_DIR, Engine, GenerationOptions
from tests.fixtures.adapters import make_random_adapter
from tests.fixtures.make_toy import sample_sentence

pytestmark = pytest.mark.gpu

ATTENTION_AND_CACHE = {"kv_append", "kv_append_lora", "decode_attention", "cross_attention", "encoder_attention"}
# name -> (d_model, heads, ffn dim, the ops that run their reference on the GPU)
MODELS = {
    "head_dim_24": (96, 4, 192, ATTENTION_AND_CACHE),
    "d_model_80": (80, 5, 160, set()),  # head dim 16, d_model off multiples of 64: every kernel takes it
    "d_model_100": (100, 4, 200, ATTENTION_AND_CACHE | {"add_layer_norm", "lora_apply"}),  # head dim 25, rows off 8
}
OPTIONS = [GenerationOptions(max_new_tokens=16), GenerationOptions(num_beams=4, num_return_sequences=2,
                                                                   max_new_tokens=16)]


def write_model(out: Path, d_model: int, heads: int, ffn: int, seed: int = 0) -> Path:
    """The toy checkpoint's tokenizer, vocabulary and layers around random weights of another width: d_model, heads
    and ffn in place of the toy's. Weights of std fan_in^-1/2 keep each layer's output near unit scale, so that
    attention is far from uniform and what comes out depends on the source."""
    config = json.loads((TOY_MODEL_DIR / "config.json").read_text())
    resize = {config["d_model"]: d_model, config["encoder_ffn_dim"]: ffn}
    config.update(d_model=d_model, encoder_attention_heads=heads, decoder_attention_heads=heads,
                  encoder_ffn_dim=ffn, decoder_ffn_dim=ffn)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("sentencepiece.bpe.model", "generation_config.json"):
        shutil.copy(TOY_MODEL_DIR / name, out / name)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, toy in load_file(TOY_MODEL_DIR / "model.safetensors").items():
        shape = [resize.get(n, n) for n in toy.shape]
        if "layer_norm" in name:
            tensors[name] = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        elif len(shape) == 1:  # a bias
            tensors[name] = torch.randn(shape, generator=gen) * 0.02
        else:
            tensors[name] = torch.randn(shape, generator=gen) * shape[-1] ** -0.5
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory):
    """(name, checkpoint directory, adapters directory holding 'all-r8', expected fallback ops)."""
    if not torch.cuda.is_available():
        pytest.fail("no CUDA device: run the gpu tests on the GPU machine")
    d_model, heads, ffn, fallbacks = MODELS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model_dir = write_model(root / "model", d_model, heads, ffn)
    make_random_adapter(model_dir, root / "adapters" / "all-r8", 8,
                        ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"], alpha=16.0)
    return request.param, model_dir, root / "adapters", fallbacks


def cases() -> list[tuple[str, str, GenerationOptions, str | None]]:
    """Greedy and beam jobs, each input once on the base model and once with the adapter."""
    rng = random.Random(23)
    inputs = [(sample_sentence(rng), rng.choice(["fra_Latn", "deu_Latn", "spa_Latn"]), OPTIONS[i % len(OPTIONS)])
              for i in range(8)]
    return [(text, tgt, opts, adapter) for text, tgt, opts in inputs for adapter in (None, "all-r8")]


def translate(eng: Engine, batch: list) -> list:
    """Every job submitted before any is awaited: rows of both searches, with and without LoRA, in each step."""
    futures = [eng.submit([text], "eng_Latn", tgt, opts, adapter=adapter) for text, tgt, opts, adapter in batch]
    return [f.result(300)[0] for f in futures]


def test_odd_model_widths_give_the_cpu_tokens_on_the_gpu(model, caplog):
    name, model_dir, adapters_dir, fallbacks = model
    batch = cases()
    cpu = Engine.load(model_dir, device="cpu", max_rows=16, adapters_dir=adapters_dir, max_adapters=2)
    try:
        want = translate(cpu, batch)
    finally:
        cpu.close()
    with caplog.at_level(logging.WARNING, logger="engine"):
        eng = Engine.load(model_dir, device="cuda", dtype="float32", max_rows=16, adapters_dir=adapters_dir,
                          max_adapters=2)
        try:
            assert set(eng.backend.fallbacks) == fallbacks, name
            got = translate(eng, batch)
            if fallbacks:  # the reference ops read lengths on the host: no CUDA graphs
                assert eng.graphs is None and not eng.backend.capturable
            else:
                assert eng.graphs is not None and eng.graphs.graphs, "every kernel runs this model: graphs expected"
        finally:
            eng.close()
    differ = [i for i, (g, w) in enumerate(zip(got, want)) if g.tokens != w.tokens]
    assert not differ, f"{name}: {len(differ)} of {len(want)} jobs differ from the CPU path, first {differ[:1]}"
    for g, w in zip(got, want):
        assert g.score == pytest.approx(w.score, abs=1e-3)
        assert [h.tokens for h in g.hypotheses] == [h.tokens for h in w.hypotheses]
    assert len({tuple(w.tokens) for w in want}) >= len(want) // 4  # what comes out depends on the input
    assert any(base.tokens != adapted.tokens for base, adapted in zip(want[::2], want[1::2]))  # the adapter acts
    logged = [r.getMessage() for r in caplog.records if "PyTorch reference" in r.getMessage()]
    assert len(logged) == (1 if fallbacks else 0), logged  # once, at load: not once a step
    if fallbacks:
        assert all(op in logged[0] for op in fallbacks), logged[0]
