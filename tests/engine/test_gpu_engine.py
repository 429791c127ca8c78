"""The GPU path (CUDA kernels + graphs) against the CPU path on the toy checkpoint. Run with -m gpu."""
from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine import Engine, GenerationOptions
from engine.step_inputs import POOL_TOKEN, prefill_inputs
from tests.engine.hf_oracle import hf_generate
from tests.fixtures.make_toy import sample_sentence

pytestmark = pytest.mark.gpu

OPTIONS = [GenerationOptions(), GenerationOptions(num_beams=4, num_return_sequences=2),
           GenerationOptions(num_beams=3, length_penalty=0.7, early_stopping=True),
           GenerationOptions(repetition_penalty=1.3, no_repeat_ngram_size=2),
           GenerationOptions(num_beams=3, repetition_penalty=1.2, no_repeat_ngram_size=3, min_new_tokens=4),
           GenerationOptions(do_sample=True, seed=5, top_k=10)]


def cases(n: int):
    rng = random.Random(99)
    return [(sample_sentence(rng), rng.choice(["fra_Latn", "deu_Latn", "spa_Latn"]), OPTIONS[i % len(OPTIONS)])
            for i in range(n)]


def run_all(eng, batch):
    futures = [eng.submit([text], "eng_Latn", tgt, opts) for text, tgt, opts in batch]
    return [f.result(300)[0] for f in futures]


@pytest.fixture(scope="module")
def cpu_results():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    eng = Engine.load(None, device="cpu", max_rows=64)
    try:
        return run_all(eng, cases(120))
    finally:
        eng.close()


def test_cuda_kernels_and_graphs_are_in_use():
    eng = Engine.load(None, device="cuda", dtype="float32", max_rows=64)
    try:
        assert eng.backend.capturable, "kernels.ops did not load: the GPU runs the reference ops"
        eng.translate(["rema sila"], "eng_Latn", "fra_Latn")
        assert eng.graphs.enabled and eng.graphs.graphs
    finally:
        eng.close()


def test_warm_up_captures_every_bucket_so_traffic_of_that_shape_captures_nothing():
    eng = Engine.load(None, device="cuda", max_rows=64)
    try:
        # decode: row buckets 1, 2, 4, 8, 16, 32; prefill: token buckets 32 ... 1024 (>= 20 x 30); bound 32
        assert eng.warm_up(rows=20, src_tokens=30) == 6 + 6
        assert eng.warm_up(rows=20, src_tokens=30) == 0
        held = set(eng.graphs.graphs), set(eng.prefill.graphs.graphs)
        texts = [sample_sentence(random.Random(i)) for i in range(20)]
        futures = [eng.submit([t], "eng_Latn", "fra_Latn") for t in texts]  # rows join over a few steps
        assert all(f.result(60) for f in futures)
        assert (set(eng.graphs.graphs), set(eng.prefill.graphs.graphs)) == held
    finally:
        eng.close()


def test_warm_up_for_beams_captures_the_graphs_their_steps_run():
    """Steps whose segments all search 4 beams, past 32 rows, run graphs of their own (their cross-attention a
    warp for a segment's rows): warm_up(beams=4) captures them, one a bucket from 64 rows, and such a job then
    captures nothing."""
    eng = Engine.load(None, device="cuda", max_rows=64, max_rows_per_job=64)
    try:
        eng.warm_up(rows=64, src_tokens=30)
        assert eng.warm_up(rows=64, src_tokens=30, beams=4) == 1
        held = set(eng.graphs.graphs)
        assert [key[1].rows_per_source for key in held].count(4) == 1
        texts = [sample_sentence(random.Random(i)) for i in range(16)]
        assert eng.translate(texts, "eng_Latn", "fra_Latn", GenerationOptions(num_beams=4, max_new_tokens=12))
        assert set(eng.graphs.graphs) == held
    finally:
        eng.close()


def sentence_of(rng: random.Random, eng: Engine, tokens: int) -> str:
    """A toy sentence of at most `tokens` source tokens (its language tag and </s> included), one word at least."""
    words = []
    while len(eng.tokenizer.encode_source(" ".join(words), "eng_Latn")) < tokens:
        words += sample_sentence(rng).split()
    while len(words) > 1 and len(eng.tokenizer.encode_source(" ".join(words), "eng_Latn")) > tokens:
        words.pop()
    return " ".join(words)


def graphs_held(eng: Engine) -> tuple[set, set]:
    return set(eng.graphs.graphs), set(eng.prefill.graphs.graphs)


def test_warm_up_covers_greedy_and_beam_sentences_of_up_to_64_tokens_at_any_row_count():
    """What a worker captures before it consumes (Engine.warm_up_sentences): jobs of that traffic capture nothing."""
    eng = Engine.load(None, device="cuda", max_rows=128, max_rows_per_job=128)
    try:
        assert eng.warm_up_sentences() > 0
        held = graphs_held(eng)
        rng = random.Random(3)
        longest = min(64, eng.max_source_tokens)
        # one-sentence jobs of every length arriving together (their rows join over a few steps), then alone
        lengths = [rng.randint(4, longest) for _ in range(40)]
        futures = [eng.submit([sentence_of(rng, eng, n)], "eng_Latn", "fra_Latn") for n in lengths]
        assert all(f.result(120) for f in futures)
        assert eng.translate([sentence_of(rng, eng, longest)], "eng_Latn", "deu_Latn")
        # beam 4: a job of 24 sentences (96 rows), and one sentence
        beams = GenerationOptions(num_beams=4, max_new_tokens=12)
        texts = [sentence_of(rng, eng, rng.randint(4, longest)) for _ in range(24)]
        assert len(eng.translate(texts, "eng_Latn", "fra_Latn", beams)) == 24
        assert eng.translate([texts[0]], "eng_Latn", "spa_Latn", beams)
        assert graphs_held(eng) == held
    finally:
        eng.close()


@pytest.mark.parametrize("lengths", [(9, 30, 1), (2, 1, 3) * 20, (31, 2) * 7 + (32,) * 9])
def test_prefill_graph_writes_the_pool_as_the_eager_prefill_does(lengths):
    """Sources padded into their bucket (many one- to three-token sources take a larger one, for their sequence
    slots): the replay writes their cross K/V where the eager prefill does, and nothing else but the scratch
    token."""
    eng = Engine.load(None, device="cuda", dtype="float32", max_rows=64)
    try:
        rng = random.Random(7)
        starts = np.cumsum((0,) + lengths[:-1]) + 5
        segments = [SimpleNamespace(src_ids=[rng.randrange(4, 200) for _ in range(n)], src_start=int(start),
                                    adapter_slot=0) for n, start in zip(lengths, starts)]
        tokens, cu = prefill_inputs(segments)
        table, pools = eng.table, []

        def prefill(graph: bool) -> None:
            table.cross_k.zero_()
            table.cross_v.zero_()
            if graph:
                assert eng.prefill.graphs.run(tokens, cu, 32, frozenset())
            else:
                eng.prefill.encode_into_pool(torch.from_numpy(tokens).cuda(), torch.from_numpy(cu).cuda(), 32,
                                             frozenset())
            pools.append((table.cross_k[:, :-1].clone(), table.cross_v[:, :-1].clone()))  # the scratch token left out
        eng._on_engine_thread(lambda: prefill(True))
        eng._on_engine_thread(lambda: prefill(False))
        (graph_k, graph_v), (eager_k, eager_v) = pools
        torch.testing.assert_close(graph_k, eager_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(graph_v, eager_v, atol=1e-5, rtol=1e-5)
        written = torch.zeros(table.source_tokens, dtype=torch.bool)
        written[tokens[POOL_TOKEN]] = True
        assert graph_k[:, written.cuda()].abs().sum(-1).gt(0).all()  # every real token's entry was written
        assert not graph_k[:, ~written.cuda()].any() and not graph_v[:, ~written.cuda()].any()
    finally:
        eng.close()


def gpu_results(dtype: str):
    eng = Engine.load(None, device="cuda", dtype=dtype, max_rows=64)
    try:
        return run_all(eng, cases(120))
    finally:
        eng.close()


def test_float32_gpu_engine_gives_the_cpu_tokens(cpu_results):
    gpu = gpu_results("float32")
    greedy_or_beam = [i for i, (_, _, o) in enumerate(cases(120)) if not o.do_sample]
    same = [gpu[i].tokens == cpu_results[i].tokens for i in greedy_or_beam]
    assert all(same), f"{same.count(False)} of {len(same)} differ"
    for i in greedy_or_beam:
        assert gpu[i].score == pytest.approx(cpu_results[i].score, abs=1e-3)


def test_bfloat16_agreement_rate_is_reported(cpu_results):
    gpu = gpu_results("bfloat16")
    agree = sum(g.tokens == c.tokens for g, c in zip(gpu, cpu_results)) / len(gpu)
    print(f"bf16 vs fp32 CPU token agreement: {agree:.1%}")
    assert agree > 0.8


# (num_beams, sentences) of the fixed batches below: rows from 20 to 1,000, in the buckets cuBLAS takes
LAUNCH_BATCHES = [(4, 5), (4, 40), (4, 100), (4, 256), (1, 150), (1, 300), (1, 1000)]


def fixed_batch_tokens(model_dir, batches: list[tuple[int, int]] = LAUNCH_BATCHES) -> list[list[list[int]]]:
    """Each of `batches` (num_beams, sentences) as one job alone, sources of 4 to 60 tokens (2 to 58 random
    pieces), exactly 20 to 50 new tokens a batch: every segment's tokens. The row cap is every row, so that each
    job is admitted whole at its first step and runs the same steps however fast the GPU runs: under the default
    cap (128 rows here) a larger job widens once no small job has arrived for WIDEN_AFTER_S, a wall-clock wait,
    and the segments admitted late share other steps (other row buckets, other GEMM kernels: other bits, other
    near-tie tokens)."""
    rows = 1024
    eng = Engine.load(model_dir, device="cuda", max_rows=rows, max_rows_per_job=rows)
    try:
        rng = random.Random(5)
        lang = eng.tokenizer.lang_id("eng_Latn", "src_lang")
        out = []
        for beams, n in batches:
            batch = [[lang] + [rng.randrange(4, 4000) for _ in range(rng.randint(2, 58))] + [2] for _ in range(n)]
            new = rng.randint(20, 50)
            opts = GenerationOptions(num_beams=beams, min_new_tokens=new, max_new_tokens=new)
            out.append([t.tokens for t in eng.generate(batch, "fra_Latn", opts)])
        return out
    finally:
        eng.close()


@pytest.fixture(scope="module")
def random_600m(tmp_path_factory):
    """A random checkpoint of the 600M shape in bf16: cuBLAS and the attention run the real shapes' kernels."""
    from bench.checkpoint import write_random_checkpoint
    return write_random_checkpoint(tmp_path_factory.mktemp("600M"), "600M", dtype=torch.bfloat16)


def test_bfloat16_tokens_with_programmatic_launch_equal_those_of_plain_launches(random_600m, monkeypatch):
    """Every kernel of ours may start before the one ahead of it ends, and waits inside (kernels/loader.py): a read
    before that wait, or an edge into a kernel that does not wait, gives other tokens than plain launches do.
    A random checkpoint of the 600M shape in bf16, so that cuBLAS runs the real shapes' kernels; its random
    weights leave near ties everywhere, so a changed bit changes tokens (edges into cuBLAS's GEMMs made
    programmatic changed 1-32 segments of each batch here, other ones run to run)."""
    from kernels import loader
    programmatic = fixed_batch_tokens(random_600m)
    assert loader.programmatic(), "launches were not programmatic: nothing to compare"
    monkeypatch.setattr(loader, "PDL", False)
    plain = fixed_batch_tokens(random_600m)
    differing = [sum(a != b for a, b in zip(x, y)) for x, y in zip(programmatic, plain)]
    assert differing == [0] * len(LAUNCH_BATCHES), f"segments with other tokens, per batch: {differing}"


def test_beam_batches_give_the_same_tokens_with_a_warp_for_a_segments_rows_in_the_cross_attention(random_600m,
                                                                                                   monkeypatch):
    """Steps whose segments all search 2 or 4 beams (from 64 rows) take the cross-attention a warp for a
    segment's rows of a head (ops.cross_attention's `group`): on the 600M shape in bf16, whose near ties turn any
    changed bit into other tokens, every segment's tokens are those of a warp a row."""
    from kernels import ops
    launched, launch = set(), ops.launch
    monkeypatch.setattr(ops, "launch", lambda name, *args: (launched.add(name), launch(name, *args))[1])
    batches = [(4, 16), (4, 100), (2, 50), (4, 256)]
    shared = fixed_batch_tokens(random_600m, batches)
    assert {"attn_group64q4_bf16", "attn_group64q2_bf16"} <= launched
    monkeypatch.setattr(ops, "GROUP_QUERIES", ())
    apart = fixed_batch_tokens(random_600m, batches)
    differing = [sum(a != b for a, b in zip(x, y)) for x, y in zip(shared, apart)]
    assert differing == [0] * len(batches), f"segments with other tokens, per batch: {differing}"


def test_adapter_and_base_jobs_on_the_gpu_give_the_cpu_tokens():
    """The committed fra-reverse adapter mixed with base jobs: GPU (fp32) tokens equal the CPU path's."""
    from engine import TOY_MODEL_DIR
    adapters = TOY_MODEL_DIR.parent / "adapters"
    batch = [(text, tgt, adapter) for text, tgt, _ in cases(40) for adapter in (None, "fra-reverse")]
    results = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "float32")):
        eng = Engine.load(None, device=device, dtype=dtype, max_rows=64, adapters_dir=adapters)
        try:
            futures = [eng.submit([text], "eng_Latn", tgt, adapter=adapter) for text, tgt, adapter in batch]
            results[device] = [f.result(300)[0].tokens for f in futures]
        finally:
            eng.close()
    assert results["cuda"] == results["cpu"]
    assert any(a != b for a, b in zip(results["cpu"][::2], results["cpu"][1::2]))  # the adapter acts


def test_selection_graph_replays_the_steps_eager_selection_takes():
    """Small plans that hold (one beam sentence; a beam and a greedy sentence side by side) have their
    selection captured and replayed (engine/selection_graph.py): the same tokens, scores and hypotheses as
    with the selection run eagerly, in float32, and as the CPU path."""
    beam = GenerationOptions(num_beams=4, num_return_sequences=3, min_new_tokens=10, max_new_tokens=14)
    one, two = (sample_sentence(random.Random(seed)) for seed in (3, 4))
    greedy = GenerationOptions(max_new_tokens=12)
    jobs = [[(one, "fra_Latn", beam)], [(one, "fra_Latn", beam), (two, "deu_Latn", greedy)]]
    cpu = Engine.load(None, device="cpu", max_rows=64)
    eng = Engine.load(None, device="cuda", dtype="float32", max_rows=64)
    try:
        for batch in jobs:
            graph = eng.selector.graph
            before = graph.captures
            replayed = run_all(eng, batch)
            assert graph.enabled and graph.captures > before  # captured (and replayed after) for this traffic
            eng._on_engine_thread(lambda: setattr(eng.selector, "graph", None))
            eager = run_all(eng, batch)
            eng._on_engine_thread(lambda: setattr(eng.selector, "graph", graph))
            for got, want, host in zip(replayed, eager, run_all(cpu, batch)):
                assert got.tokens == want.tokens == host.tokens
                assert got.score == want.score == pytest.approx(host.score, abs=1e-3)
                assert [h.tokens for h in got.hypotheses] == [h.tokens for h in want.hypotheses]
    finally:
        eng.close()
        cpu.close()


def test_float32_gpu_sampling_and_processors_draw_hf_generate_tokens_on_the_gpu(hf_toy):
    """Sampled jobs (temperature, top-k, top-p, penalties: the processor kernels) and history-processor jobs,
    all submitted at once, against HF generate on the GPU alone per job, same seeds."""
    sweep = [GenerationOptions(do_sample=True, seed=s, temperature=t, top_k=k, top_p=p, repetition_penalty=r,
                               no_repeat_ngram_size=n)
             for s, (t, k, p, r, n) in enumerate([(1.0, 50, 1.0, 1.0, 0), (0.5, 0, 0.9, 1.0, 0), (1.5, 5, 0.5, 1.3, 0),
                                                  (1.0, 0, 1.0, 1.0, 2), (0.8, 20, 0.95, 0.7, 3)])]
    sweep += [GenerationOptions(repetition_penalty=1.5, no_repeat_ngram_size=1, max_new_tokens=30),
              GenerationOptions(num_beams=4, repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=6)]
    rng = random.Random(5)
    batch = [(sample_sentence(rng), rng.choice(["fra_Latn", "deu_Latn"]), sweep[i % len(sweep)]) for i in range(28)]
    eng = Engine.load(None, device="cuda", dtype="float32", max_rows=64)
    try:
        got = run_all(eng, batch)
        tok = eng.tokenizer
        model = hf_toy.to("cuda")
        want = [hf_generate(model, tok.encode_source(text, "eng_Latn"), tok.lang_id(tgt), opts).tokens[0]
                for text, tgt, opts in batch]
    finally:
        hf_toy.to("cpu")
        eng.close()
    same = [g.tokens == w for g, w in zip(got, want)]
    assert all(same), f"{same.count(False)} of {len(same)} differ"
