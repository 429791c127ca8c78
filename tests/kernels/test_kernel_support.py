"""The model shape check (kernels/support.py) and what the engine makes of it (engine/devices.py, Backend.for_model):
which CUDA ops a checkpoint's shapes rule out, that exactly those run their PyTorch reference, and that shapes no
path runs are refused at load. CPU only: the check needs neither CuPy nor a GPU."""
from __future__ import annotations

import inspect
import json
import logging
import shutil
import subprocess
import sys
from dataclasses import replace
from types import ModuleType

import pytest
import torch

from engine import TOY_MODEL_DIR, Engine, GenerationOptions
from engine.config import load_config
from engine.devices import Backend, select_backend
from engine.errors import CheckpointError, InvalidRequest
from engine.lora import RANK_LIMIT
from kernels import reference
from kernels.limits import BEAM_MAX, INT32_MAX, LN_MAX_D, LORA_MAX_RANK, TOPK_MAX
from kernels.support import CACHE_AND_ATTENTION_OPS, VOCAB_OPS, ModelShapes, unrunnable, unsupported_ops
from bench.checkpoint import NLLB_VOCAB, SHAPES

ROOT = TOY_MODEL_DIR.parents[2]
OPS_API = {name for name, _ in inspect.getmembers(reference, inspect.isfunction) if not name.startswith("_")}
ATTENTION = set(CACHE_AND_ATTENTION_OPS)


def shapes(d_model: int, heads: int, ffn: int = 256, vocab: int = NLLB_VOCAB) -> ModelShapes:
    return ModelShapes(d_model, heads, (ffn, ffn), vocab)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_real_nllb_shapes_need_no_reference_op(name):
    d, _, _, heads, ffn = SHAPES[name]
    assert unsupported_ops(shapes(d, heads, ffn)) == {}
    assert unrunnable(shapes(d, heads, ffn)) == []


def test_the_toy_checkpoint_needs_no_reference_op():
    assert unsupported_ops(ModelShapes.of(load_config(TOY_MODEL_DIR))) == {}


def test_head_dim_24_rules_out_the_attention_and_kv_cache_kernels_only():
    found = unsupported_ops(shapes(96, 4))
    assert set(found) == ATTENTION
    assert all("head dim 24" in why for why in found.values())


@pytest.mark.parametrize("d_model, heads", [(80, 5), (80, 10), (160, 5), (160, 10), (200, 25), (1088, 17)])
def test_a_d_model_off_multiples_of_64_with_a_power_of_two_head_dim_needs_no_reference_op(d_model, heads):
    assert unsupported_ops(shapes(d_model, heads, ffn=4 * d_model)) == {}


def test_a_d_model_off_multiples_of_8_rules_out_every_kernel_reading_its_rows_in_vectors():
    found = unsupported_ops(shapes(100, 4, ffn=400))  # head dim 25
    assert set(found) == ATTENTION | {"add_layer_norm", "lora_apply"}
    assert "head dim 25" in found["decode_attention"] and "d_model 100" in found["add_layer_norm"]
    assert "head dim 25" in found["kv_append_lora"] and "d_model 100" in found["kv_append_lora"]  # both reasons


def test_a_d_model_over_the_layer_norm_kernel_rules_out_it_alone_until_the_lora_qkv_block_is_full():
    assert set(unsupported_ops(shapes(2 * LN_MAX_D, 2 * LN_MAX_D // 128))) == {"add_layer_norm"}  # head dim 128
    assert set(unsupported_ops(shapes(4 * LN_MAX_D, 4 * LN_MAX_D // 128))) == {"add_layer_norm", "kv_append_lora"}


@pytest.mark.parametrize("ffn", [4100, 4098])  # not a multiple of 8 (fc2's input), of 4 (fc1's output)
def test_an_ffn_dim_off_the_lora_kernel_rules_out_lora_apply_alone(ffn):
    found = unsupported_ops(ModelShapes(1024, 16, (4096, ffn), NLLB_VOCAB))
    assert set(found) == {"lora_apply"} and str(ffn) in found["lora_apply"]


def test_a_vocabulary_over_int32_rules_out_the_selection_kernels():
    assert set(unsupported_ops(shapes(1024, 16, vocab=INT32_MAX + 1))) == set(VOCAB_OPS)
    assert unsupported_ops(shapes(1024, 16, vocab=INT32_MAX)) == {}


def test_every_op_the_check_can_name_is_an_op_of_the_api():
    worst = ModelShapes(100, 4, (402, 402), INT32_MAX + 1)
    assert set(unsupported_ops(worst)) <= OPS_API
    assert ATTENTION | set(VOCAB_OPS) <= OPS_API


def test_a_vocabulary_smaller_than_beam_search_ranks_is_refused_by_name():
    assert unrunnable(shapes(1024, 16, vocab=2 * BEAM_MAX)) == []
    (refusal,) = unrunnable(shapes(1024, 16, vocab=2 * BEAM_MAX - 1))
    assert f"vocab_size {2 * BEAM_MAX - 1}" in refusal


def test_the_limits_agree_with_what_the_engine_asks_of_the_kernels():
    assert 2 * BEAM_MAX <= TOPK_MAX  # a beam step's top-k
    GenerationOptions(num_beams=BEAM_MAX)
    with pytest.raises(InvalidRequest):
        GenerationOptions(num_beams=BEAM_MAX + 1)
    assert RANK_LIMIT <= LORA_MAX_RANK  # the registry's stacks never hold a rank the LoRA kernels refuse


def test_the_check_imports_without_torch_or_cupy():
    code = ("import sys; sys.modules['torch'] = sys.modules['cupy'] = None; "
            "from kernels.support import ModelShapes, unsupported_ops; print(unsupported_ops(ModelShapes(96, 4, "
            "(256, 256), 460)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "decode_attention" in out.stdout


# ---- Backend.for_model -------------------------------------------------------------------------------------
def kernel_backend() -> Backend:
    """A CUDA backend whose 'kernels' are stand-ins (one distinct function per op): what for_model picks is seen
    by identity, with no GPU."""
    fake = ModuleType("fake_kernels")
    for name in OPS_API:
        setattr(fake, name, lambda *args, **kwargs: None)
    fake.KERNEL_SETTING = object()  # what else the module offers (constants, argument types) comes along
    return Backend(torch.device("cuda"), torch.float32, fake)


def toy_config(**fields):
    return replace(load_config(TOY_MODEL_DIR), **fields)


@pytest.mark.parametrize("fields", [dict(d_model=96), dict(d_model=100, encoder_ffn_dim=402, decoder_ffn_dim=402),
                                    dict(d_model=2 * LN_MAX_D, decoder_heads=2 * LN_MAX_D // 128)])
def test_for_model_runs_the_reference_for_exactly_the_ops_the_check_names(fields, caplog):
    backend, cfg = kernel_backend(), toy_config(**fields)
    named = unsupported_ops(ModelShapes.of(cfg))
    assert named and backend.capturable
    with caplog.at_level(logging.WARNING, logger="engine"):
        model_backend = backend.for_model(cfg)
    for op in OPS_API:
        want = getattr(reference if op in named else backend.ops, op)
        assert getattr(model_backend.ops, op) is want, op
    assert model_backend.ops.KERNEL_SETTING is backend.ops.KERNEL_SETTING
    assert model_backend.fallbacks == named
    assert not model_backend.capturable  # the reference ops read lengths on the host: no CUDA graphs
    (record,) = caplog.records  # once, naming every op and why
    assert all(op in record.getMessage() and why in record.getMessage() for op, why in named.items())


def test_for_model_keeps_the_backend_where_every_kernel_runs_the_model(caplog):
    backend = kernel_backend()
    with caplog.at_level(logging.WARNING, logger="engine"):
        assert backend.for_model(toy_config(d_model=80, decoder_heads=5)) is backend
    assert backend.capturable and not caplog.records


def test_for_model_on_the_reference_ops_substitutes_nothing():
    cpu = select_backend("cpu")
    assert cpu.for_model(toy_config(d_model=96)) is cpu


@pytest.mark.parametrize("backend", [kernel_backend(), select_backend("cpu")], ids=["cuda", "cpu"])
def test_for_model_refuses_what_no_path_runs(backend):
    with pytest.raises(CheckpointError, match=f"vocab_size {2 * BEAM_MAX - 1}"):
        backend.for_model(toy_config(vocab_size=2 * BEAM_MAX - 1))


def test_engine_load_refuses_such_a_checkpoint_before_reading_its_weights(tmp_path):
    config = json.loads((TOY_MODEL_DIR / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    shutil.copy(TOY_MODEL_DIR / "sentencepiece.bpe.model", tmp_path)
    with pytest.raises(CheckpointError, match="vocab_size 100: beam search"):
        Engine.load(tmp_path, device="cpu", max_rows=8)
