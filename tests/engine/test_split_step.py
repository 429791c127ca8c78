"""A decode step of many rows whose decoder runs as two halves on two streams (step_loop.SPLIT_ROWS): where it cuts,
and, on the GPU, that the split step's logits are those of each half's decoder run alone."""
from __future__ import annotations

import pytest
import torch

from engine import Engine, step_loop
from engine.graphs import StepBounds
from engine.step_inputs import RowInputs


@pytest.fixture
def cuda_loop():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    eng = Engine.load(None, device="cuda", max_rows=512)
    yield eng.loop
    eng.close()


@pytest.mark.parametrize("n, rows_per_source, cut", [(256, 1, 128), (257, 1, 129), (256, 4, 128), (260, 4, 132),
                                                     (384, 3, 192), (129, 1, 65)])
def test_halves_cut_between_runs_of_rows_that_share_a_source(monkeypatch, n, rows_per_source, cut):
    monkeypatch.setattr(step_loop, "SPLIT_ROWS", 128)
    first, second = step_loop.split_halves(n, rows_per_source)
    assert (first.start, first.stop, second.start, second.stop) == (0, cut, cut, n)
    assert cut % rows_per_source == 0
    assert step_loop.split_halves(127, 1) is None
    monkeypatch.setattr(step_loop, "SPLIT_ROWS", None)
    assert step_loop.split_halves(n, rows_per_source) is None


def test_the_cpu_runs_every_step_whole(monkeypatch):
    """No second stream there: a step of any size is one chain of the reference ops."""
    monkeypatch.setattr(step_loop, "SPLIT_ROWS", 2)
    eng = Engine.load(None, device="cpu", max_rows=8)
    try:
        calls = []
        decode_hidden = eng.loop._decode_hidden
        monkeypatch.setattr(eng.loop, "_decode_hidden", lambda inputs, *a: (calls.append(inputs.size),
                                                                           decode_hidden(inputs, *a))[1])
        eng.generate([[eng.tokenizer.lang_id("eng_Latn", "src_lang"), 10, 11, 2]] * 4, "fra_Latn")
        assert calls and set(calls) == {4}
    finally:
        eng.close()


def step_inputs(n: int, rows_per_source: int, loop, seed: int = 3) -> RowInputs[torch.Tensor]:
    """n rows on distinct slot rows at positions 0-39, each run of `rows_per_source` rows on one source of 1-32
    tokens at a random pool offset."""
    g = torch.Generator().manual_seed(seed)
    runs = -(-n // rows_per_source)
    source = [torch.randint(0, 64, (runs,), generator=g), torch.randint(1, 33, (runs,), generator=g)]
    src_start, src_len = (t.repeat_interleave(rows_per_source)[:n] for t in source)
    cols = [torch.randint(4, loop.cfg.vocab_size, (n,), generator=g), torch.randint(0, 40, (n,), generator=g),
            torch.randperm(loop.table.rows_total, generator=g)[:n], src_start, src_len,
            torch.zeros(n, dtype=torch.long)]
    return RowInputs(torch.stack(cols).cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("n, rows_per_source", [(256, 1), (301, 1), (512, 4)])
def test_a_split_step_gives_the_logits_of_each_halfs_decoder_run_alone(cuda_loop, monkeypatch, n, rows_per_source):
    """Each half's rows read and write only their own slot rows, so two streams give the bits of the two halves'
    decoders run one after the other, the LM head then over every row (a race on a shared buffer or a missed wait
    would not)."""
    monkeypatch.setattr(step_loop, "SPLIT_ROWS", 128)
    inputs, bounds = step_inputs(n, rows_per_source, cuda_loop), StepBounds(32, 128, rows_per_source)
    halves = step_loop.split_halves(n, rows_per_source)
    split = cuda_loop._decode_logits(inputs, bounds, None).clone()
    alone = cuda_loop.model.logits(torch.cat([cuda_loop._decode_hidden(inputs.columns(h), bounds, None)
                                              for h in halves]))
    torch.cuda.synchronize()
    assert split.shape == (n, cuda_loop.cfg.vocab_size)
    assert torch.equal(split, alone)
    assert split.abs().sum(-1).gt(0).all()  # every row written
