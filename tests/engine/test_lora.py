"""Per-job LoRA: PEFT adapters of different ranks and targets mixed with base jobs, HF+PEFT parity."""
from __future__ import annotations

import json
import random
import time

import pytest
import torch
import torch.nn.functional as F

from engine import Engine, GenerationOptions
from engine.engine import TOY_ADAPTERS_DIR
from engine.errors import UnknownAdapter
from kernels.limits import LORA_MAX_SLOTS
from tests.engine.hf_oracle import hf_generate
from tests.fixtures.adapters import make_random_adapter
from tests.fixtures.make_toy import sample_sentence

ADAPTERS = {
    "attn-r4": dict(r=4, targets=["q_proj", "v_proj"], alpha=8.0),
    "all-r16": dict(r=16, targets=["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"], alpha=32.0),
    "ffn-r8-rs": dict(r=8, targets=r".*decoder.*(fc1|fc2)|.*encoder_attn\.(k_proj|out_proj)", alpha=4.0, rslora=True),
}


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory, toy_dir):
    root = tmp_path_factory.mktemp("adapters")
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        make_random_adapter(toy_dir, root / name, spec["r"], spec["targets"], spec["alpha"],
                            spec.get("rslora", False), seed=seed)
    return root


@pytest.fixture(scope="module")
def lora_engine(toy_dir, adapters_dir):
    eng = Engine.load(toy_dir, device="cpu", max_rows=32, adapters_dir=adapters_dir, max_adapters=2)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def peft_models(toy_dir, adapters_dir):
    from peft import PeftModel
    from transformers import M2M100ForConditionalGeneration

    models = {None: M2M100ForConditionalGeneration.from_pretrained(toy_dir).eval()}
    for name in ADAPTERS:
        base = M2M100ForConditionalGeneration.from_pretrained(toy_dir)
        models[name] = PeftModel.from_pretrained(base, adapters_dir / name).eval()
    return models


def test_mixed_adapters_and_base_jobs_in_one_batch_match_peft(lora_engine, peft_models):
    assert_mixed_batch_matches_peft(lora_engine, peft_models, score_tol=1e-4)


@pytest.mark.gpu
def test_mixed_adapters_on_the_gpu_match_peft(toy_dir, adapters_dir, peft_models):
    """The same mix through the CUDA kernels and graphs (float32): the gathered LoRA kernel at every site."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    eng = Engine.load(toy_dir, device="cuda", dtype="float32", max_rows=32, adapters_dir=adapters_dir,
                      max_adapters=2)
    try:
        assert eng.backend.capturable, "kernels.ops did not load: the GPU runs the reference ops"
        assert_mixed_batch_matches_peft(eng, peft_models, score_tol=1e-3)
        assert any(sites for _, _, sites in eng.graphs.graphs), "no adapter step ran in a CUDA graph"
    finally:
        eng.close()


def assert_mixed_batch_matches_peft(lora_engine: Engine, peft_models: dict, score_tol: float) -> None:
    rng = random.Random(11)
    options = [GenerationOptions(max_new_tokens=24), GenerationOptions(num_beams=3, max_new_tokens=24)]
    cases = [(sample_sentence(rng), rng.choice(["fra_Latn", "deu_Latn"]), name, rng.choice(options))
             for _ in range(6) for name in [None, *ADAPTERS]]
    rng.shuffle(cases)  # three adapters (max two resident) and base jobs interleaved
    futures = [lora_engine.submit([text], "eng_Latn", tgt, opts, adapter=name) for text, tgt, name, opts in cases]
    tok = lora_engine.tokenizer
    differs_from_base = 0
    for (text, tgt, name, opts), future in zip(cases, futures):
        got = future.result(120)[0]
        want = hf_generate(peft_models[name], tok.encode_source(text, "eng_Latn"), tok.lang_id(tgt), opts)
        assert got.tokens == want.tokens[0], (name, text, tgt)
        assert got.score == pytest.approx(want.scores[0], abs=score_tol)
        if name is not None:
            base = hf_generate(peft_models[None], tok.encode_source(text, "eng_Latn"), tok.lang_id(tgt), opts)
            differs_from_base += base.tokens[0] != got.tokens
    assert differs_from_base > len(cases) // 2  # the adapters really change what comes out
    assert lora_engine.table.is_empty


def test_least_recently_used_adapter_leaves_when_slots_run_out(lora_engine):
    for name in ADAPTERS:  # three adapters through two slots
        lora_engine.translate(["rema sila"], "eng_Latn", "fra_Latn", adapter=name)
    registry = lora_engine.adapters
    assert len(registry.slot_of) == 2 and list(ADAPTERS)[0] not in registry.slot_of
    assert all(count == 0 for count in registry.refs.values())


def test_adapter_added_to_the_directory_is_found_without_restart(lora_engine, adapters_dir, toy_dir):
    with pytest.raises(UnknownAdapter):
        lora_engine.submit(["rema"], "eng_Latn", "fra_Latn", adapter="late-comer")
    make_random_adapter(toy_dir, adapters_dir / "late-comer", 2, ["fc1"], seed=9)
    assert lora_engine.translate(["rema"], "eng_Latn", "fra_Latn", adapter="late-comer")[0].text is not None


def write_config(folder, **fields):
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(fields)
    (folder / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit, message", [
    (lambda f: write_config(f, use_dora=True), "DoRA"),
    (lambda f: write_config(f, target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
    (lambda f: write_config(f, r=128), "rank 128"),
    (lambda f: write_config(f, peft_type="IA3"), "IA3"),
    (lambda f: (f / "adapter_config.json").write_text("{"), "not valid JSON"),
])
def test_unsupported_adapter_configs_are_refused_with_the_reason(tmp_path, toy_dir, edit, message):
    folder = make_random_adapter(toy_dir, tmp_path / "bad", 4, ["q_proj"])
    edit(folder)
    eng = Engine.load(toy_dir, device="cpu", max_rows=4, adapters_dir=tmp_path)
    try:
        with pytest.raises(UnknownAdapter, match=message):
            eng.submit(["rema"], "eng_Latn", "fra_Latn", adapter="bad")
        assert eng.translate(["rema"], "eng_Latn", "fra_Latn")[0].tokens  # base jobs go on
    finally:
        eng.close()


def test_adapter_with_shapes_of_another_model_fails_its_job_only(tmp_path, toy_dir):
    folder = make_random_adapter(toy_dir, tmp_path / "alien", 4, ["fc1"])
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "adapter_model.safetensors")
    save_file({k: torch.zeros(v.shape[0] + 1, v.shape[1]) if "lora_A" in k else v for k, v in tensors.items()},
              folder / "adapter_model.safetensors")
    eng = Engine.load(toy_dir, device="cpu", max_rows=4, adapters_dir=tmp_path)
    try:
        future = eng.submit(["rema"], "eng_Latn", "fra_Latn", adapter="alien")
        with pytest.raises(UnknownAdapter, match="base"):
            future.result(30)
        started = time.time()
        assert eng.translate(["rema"], "eng_Latn", "fra_Latn")[0].tokens and time.time() - started < 30
        assert eng.table.is_empty
    finally:
        eng.close()


def test_unknown_adapter_is_refused_without_the_folder_or_other_adapters_names(lora_engine):
    with pytest.raises(UnknownAdapter, match="'nope' is not served") as refused:
        lora_engine.submit(["rema"], "eng_Latn", "fra_Latn", adapter="nope")
    message = str(refused.value)
    assert str(lora_engine.adapters.dir) not in message and not any(name in message for name in ADAPTERS)
    with pytest.raises(UnknownAdapter, match="folder name"):
        lora_engine.submit(["rema"], "eng_Latn", "fra_Latn", adapter="../etc")


def test_installed_sites_grow_with_each_adapter_and_key_graphs(lora_engine):
    for name in ADAPTERS:
        lora_engine.translate(["rema sila"], "eng_Latn", "fra_Latn", adapter=name)
    sites = lora_engine.adapters.installed_sites
    assert isinstance(sites, frozenset) and hash(sites) is not None  # a CUDA graph key
    assert {site for _, _, site in sites} >= {"qkv", "fc1", "fc2", "cross_kv", "cross_out"}  # all three targets


def test_reference_lora_tiles_group_each_adapters_rows_and_skip_base_rows():
    from kernels.reference import LORA_TILE, lora_tiles
    idx = torch.tensor([0, 2, 1, 2, 2, 0, 2, 2, 1] + [3] * 17 + [7, -1])  # 7 and -1: outside slots 1..3
    tiles = lora_tiles(idx, 4)
    assert tiles.shape == (idx.numel() // LORA_TILE + 4, 32)
    used = [(rec[LORA_TILE], rec[:rec[LORA_TILE + 1]]) for rec in tiles.tolist() if rec[LORA_TILE + 1]]
    assert used == [(1, [2, 8]), (2, [1, 3, 4, 6, 7]), (3, list(range(9, 25))), (3, [25])]


def test_registry_stacks_each_slots_a_under_the_decoder_weights(lora_engine):
    """The decoder step's sites keep their base weight as the first rows of the stacked weight (the Linear a view of
    it), and a resident adapter's A sits at rows P*O + (s*P + p)*R of its slot, zero past its rank."""
    from safetensors.torch import load_file
    reg = lora_engine.adapters
    lora_engine.translate(["rema sila"], "eng_Latn", "fra_Latn", adapter="attn-r4")
    slot = reg.slot_of["attn-r4"]
    tensors = load_file(reg.dir / "attn-r4" / "adapter_model.safetensors")
    layer = lora_engine.model.w.decoder[0]
    w_ext = reg.W_ext[("decoder", 0, "qkv")]
    d, S, R = layer.qkv.weight.shape[1], reg.slots, reg.Bt[("decoder", 0, "qkv")].shape[2]
    assert layer.qkv.weight.data_ptr() == w_ext.data_ptr() and layer.qkv.weight.shape == (3 * d, d)
    stacked = w_ext[3 * d:].view(S, 3, R, d)
    for part, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        key = next((k for k in tensors if f"decoder.layers.0.self_attn.{proj}.lora_A" in k), None)
        want = torch.zeros(R, d) if key is None else torch.cat([tensors[key], torch.zeros(R - 4, d)])
        assert torch.equal(stacked[slot, part], want.to(stacked.dtype))
    assert not stacked[0].any()  # slot 0 (no adapter) is never written


def test_reference_expand_after_the_stacked_gemm_is_the_tiles_path():
    """The decoder step's LoRA (one GEMM over W stacked on every slot's A, then each row's delta) against the
    prefill's (the projection, then lora_apply over tiles), in float32 on the CPU."""
    from kernels import reference as ref
    g = torch.Generator().manual_seed(3)
    S, P, R, d_in, d_out, n = 4, 3, 16, 32, 24, 11
    ranks = torch.tensor([0, 16, 5, 0], dtype=torch.int32)
    A = torch.randn(S, P, R, d_in, generator=g) * (torch.arange(R) < ranks[:, None, None])[..., None]
    Bt = torch.randn(S, P, R, d_out, generator=g)
    W, b, x = torch.randn(P * d_out, d_in, generator=g), torch.randn(P * d_out, generator=g), torch.randn(n, d_in)
    idx = torch.randint(0, S, (n,), generator=g)
    want = F.linear(x, W, b)
    ref.lora_apply(want, x, A, Bt, idx, ranks, ref.lora_tiles(idx, S))
    w_ext = torch.cat([W, A.reshape(S * P * R, d_in)])
    b_ext = torch.cat([b, torch.zeros(P * S * R)])
    got = ref._lora_expand(F.linear(x, w_ext, b_ext), Bt, idx, ranks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reference_shrink_in_the_norm_then_the_gemm_over_b_columns_is_the_tiles_path():
    """Cross q's and fc1's LoRA in the decoder step (add_layer_norm's shrink appends each row's h, one GEMM over
    the weight with every slot's B after its columns) against the prefill's (lora_apply over tiles), float32."""
    from kernels import reference as ref
    from kernels.site_lora import SiteLora
    g = torch.Generator().manual_seed(4)
    S, R, d, d_out, n = 4, 16, 32, 40, 11
    ranks = torch.tensor([0, 16, 5, 0], dtype=torch.int32)
    A = torch.randn(S, 1, R, d, generator=g) * (torch.arange(R) < ranks[:, None, None])[..., None]
    Bt = torch.randn(S, 1, R, d_out, generator=g)
    W, b = torch.randn(d_out, d, generator=g), torch.randn(d_out, generator=g)
    residual, norm_w, norm_b = torch.randn(n, d, generator=g), torch.randn(d, generator=g), torch.randn(d, generator=g)
    idx = torch.randint(0, S, (n,), generator=g)
    _, normed = ref.add_layer_norm(residual, None, norm_w, norm_b, 1e-5)
    want = F.linear(normed, W, b)
    ref.lora_apply(want, normed, A, Bt, idx, ranks, ref.lora_tiles(idx, S))
    _, normed_ext = ref.add_layer_norm(residual, None, norm_w, norm_b, 1e-5, shrink=SiteLora(A, idx, ranks))
    w_ext = torch.cat([W, Bt[:, 0].reshape(S * R, d_out).T], dim=1)  # B of slot s, rank r at column d + s*R + r
    torch.testing.assert_close(F.linear(normed_ext, w_ext, b), want, rtol=1e-5, atol=1e-5)


def test_more_resident_adapters_than_the_kernels_have_slots_are_refused_at_load(toy_dir):
    with pytest.raises(ValueError, match=f"at most {LORA_MAX_SLOTS - 1} adapters"):
        Engine.load(toy_dir, device="cpu", max_rows=4, adapters_dir=TOY_ADAPTERS_DIR, max_adapters=LORA_MAX_SLOTS)
