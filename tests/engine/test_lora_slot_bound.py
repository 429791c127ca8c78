"""A decode step's slot bound (lora.AdapterRegistry.slot_bound): a step whose rows hold only low adapter slots
runs its GEMMs over the stacked weights of those slots alone, and gives what the whole stacks give."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import Engine
from engine.lora import aligned_slots
from kernels import reference as ref
from kernels.site_lora import SiteLora
from tests.fixtures.adapters import make_random_adapter

ALL = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory, toy_dir):
    root = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(("a", "b", "c")):
        make_random_adapter(toy_dir, root / name, 8, ALL, 16.0, seed=seed)
    return root


@pytest.fixture(scope="module")
def engine(toy_dir, adapters_dir):
    eng = Engine.load(toy_dir, device="cpu", max_rows=8, adapters_dir=adapters_dir, max_adapters=4)
    eng.translate(["rema sila"], "eng_Latn", "fra_Latn", adapter="a")  # slot 1
    yield eng
    eng.close()


def test_the_bound_is_the_first_quarter_of_the_slots_while_every_row_is_in_it(engine):
    reg = engine.adapters
    assert reg.slots == 5  # 4 adapters and slot 0 (rank limit 64: any slot count is aligned)
    assert reg.slot_bound(set()) == reg.slot_bound({1}) == 2
    assert reg.slot_bound({1, 2}) == reg.slot_bound({4}) == 5


def test_stacks_and_bounds_are_whole_64_column_blocks_at_small_ranks(toy_dir, adapters_dir):
    """At rank limit 16, 32 adapters take 33 slots, stacked as 36 (36 x 16 = 576 = 9 x 64); the tight bound 9 as
    12; the unused slots are never handed out."""
    assert [aligned_slots(s, r) for s, r in [(33, 16), (9, 16), (5, 64), (3, 32), (2, 8)]] == [36, 12, 5, 4, 8]
    eng = Engine.load(toy_dir, device="cpu", max_rows=4, adapters_dir=adapters_dir, max_adapters=32,
                      max_lora_rank=16)
    try:
        reg = eng.adapters
        d = eng.cfg.d_model
        assert reg.slots == 36 and reg.slot_bound({8}) == 12 and reg.slot_bound({12}) == 36
        assert reg.W_ext[("decoder", 0, "qkv")].shape == (3 * d + 36 * 3 * 16, d)
        assert reg.free_slots == list(range(1, 33))
    finally:
        eng.close()


def test_stacks_cut_to_the_bound_give_what_the_whole_stacks_give(engine):
    """q|k|v (each slot's A rows under the weight, slot-major) and fc1 (its h from the LayerNorm, each slot's B
    columns after the weight) over the first 2 slots, against all 5, for rows of slots 0 and 1 (fp32)."""
    reg = engine.adapters
    slot = reg.slot_of["a"]
    idx = torch.tensor([slot, 0, slot, slot])
    whole = reg.batch(idx, reg.installed_sites, ref, tiled=False)
    cut = reg.batch(idx, reg.installed_sites, ref, tiled=False, slots=reg.slot_bound({slot}))
    g = torch.Generator().manual_seed(5)
    d = engine.cfg.d_model
    x, residual = torch.randn(4, d, generator=g), torch.randn(4, d, generator=g)
    w, b = torch.randn(d, generator=g), torch.randn(d, generator=g)

    def qkv(lora):
        site = ("decoder", 0, "qkv")
        y_ext = F.linear(x, lora.W_ext[site], lora.b_ext[site])
        return y_ext.shape[1], ref._lora_expand(y_ext, lora.Bt[site], idx, lora.ranks[site])

    def fc1(lora):
        site = ("decoder", 1, "fc1")
        _, normed = ref.add_layer_norm(residual, x, w, b, 1e-5, shrink=SiteLora(lora.A[site], idx, lora.ranks[site]))
        return normed.shape[1], F.linear(normed, lora.W_ext[site], lora.b_ext[site])

    for proj in (qkv, fc1):
        (cut_width, got), (whole_width, want) = proj(cut), proj(whole)
        assert cut_width < whole_width  # the step's GEMM is narrower
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(qkv(whole)[1], F.linear(x, engine.model.w.decoder[0].qkv.weight,
                                                   engine.model.w.decoder[0].qkv.bias))  # the adapter adds


@pytest.mark.gpu
def test_warm_up_captures_both_bounds_so_adapter_traffic_captures_nothing(toy_dir, adapters_dir):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    eng = Engine.load(toy_dir, device="cuda", max_rows=8, adapters_dir=adapters_dir, max_adapters=4)
    try:
        eng.translate(["rema sila"], "eng_Latn", "fra_Latn", adapter="a")  # installed: the sites are known
        eng.warm_up(rows=4, src_tokens=16, adapted=True)
        held = set(eng.graphs.graphs)
        assert {lora.slots for _, _, lora in held if lora} == {2, 5}
        for names in (["a"], ["a", "b", "c"]):  # slot 1 alone (bound 2), then slots 1-3 (bound 5)
            futures = [eng.submit(["rema sila"], "eng_Latn", "fra_Latn", adapter=n) for n in names]
            assert all(f.result(60) for f in futures)
        assert set(eng.graphs.graphs) == held
    finally:
        eng.close()
