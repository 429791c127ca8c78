"""bench/lora.py's adapters: PEFT layout the engine loads, every adaptable site, non-zero, seeded."""
from __future__ import annotations

import shutil

import pytest
import torch

from bench import lora
from engine import Engine, GenerationOptions
from engine.config import load_config
from engine.lora import load_adapter, site_shapes
from bench.checkpoint import write_random_checkpoint


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", dtype=torch.float32)


def test_adapters_load_through_the_engine_reader(tiny_ckpt, tmp_path):
    folders = lora.write_adapters(tiny_ckpt, tmp_path, 2)
    assert [f.name for f in folders] == lora.adapter_names(2) == ["bench-r16-00", "bench-r16-01"]
    cfg = load_config(tiny_ckpt)
    shapes = site_shapes(cfg)
    loaded = [load_adapter(f, cfg, max_rank=lora.RANK) for f in folders]
    for weights in loaded:
        assert set(weights.parts) == set(shapes), "every projection of every layer is adapted"
        for site, parts in weights.parts.items():
            n_parts, d_in, d_out = shapes[site]
            assert sorted(parts) == list(range(n_parts))
            for a, b in parts.values():
                assert a.shape == (lora.RANK, d_in) and b.shape == (d_out, lora.RANK)
                assert a.abs().sum() > 0 and b.abs().sum() > 0
    site = ("decoder", 0, "fc1")
    assert not torch.equal(loaded[0].parts[site][0][1], loaded[1].parts[site][0][1]), "one seed per adapter"
    again = load_adapter(lora.write_adapters(tiny_ckpt, tmp_path / "again", 1)[0], cfg, max_rank=lora.RANK)
    assert torch.equal(again.parts[site][0][1], loaded[0].parts[site][0][1]), "seeded: the same on every run"


def test_mixed_jobs_run_their_adapters(tiny_ckpt):
    assert lora.engine_options(["greedy_b256", "stream"], tiny_ckpt) == {}
    opts = lora.engine_options(["greedy_b256_lora8"], tiny_ckpt)
    eng = None
    try:
        assert {k: v for k, v in opts.items() if k != "adapters_dir"} == {"max_adapters": 32, "max_lora_rank": 16}
        assert sorted(p.name for p in opts["adapters_dir"].iterdir()) == lora.adapter_names(8)
        eng = Engine.load(tiny_ckpt, device="cpu", max_rows=16, **opts)
        src = [[eng.tokenizer.lang_id("eng_Latn", "src_lang"), *range(10 + i, 20 + i), 2] for i in range(8)]
        greedy = GenerationOptions(min_new_tokens=6, max_new_tokens=6)
        names = lora.adapter_names(8)
        lora.make_resident(eng, names, src[0], "fra_Latn")
        base = eng.generate(src, "fra_Latn", greedy)
        mixed = lora.generate_mixed(eng, src, "fra_Latn", greedy, names)
        assert [len(r.tokens) for r in mixed] == [len(r.tokens) for r in base]
        assert any(m.tokens != b.tokens for m, b in zip(mixed, base)), "the adapters change the output"
        alone = [eng.generate([s], "fra_Latn", greedy, adapter=names[i])[0] for i, s in enumerate(src)]
        assert [r.tokens for r in mixed] == [r.tokens for r in alone], "job i runs adapter i % N"
    finally:
        if eng is not None:
            eng.close()
        shutil.rmtree(opts["adapters_dir"])


def test_with_base_runs_the_no_adapter_row_first():
    base = lora.BASE_WORKLOAD
    assert lora.with_base(["greedy_b16", "greedy_b256_lora8"]) == ["greedy_b16", base, "greedy_b256_lora8"]
    assert lora.with_base(["greedy_b256_lora1", base]) == [base, "greedy_b256_lora1"]
    assert lora.with_base([base, "greedy_b256_lora1"]) == [base, "greedy_b256_lora1"]
    assert lora.with_base(["stream"]) == ["stream"]
