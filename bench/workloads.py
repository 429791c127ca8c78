"""The bench's workloads with fixed shapes (batches, one sentence, sampling) and the arrival stream: their
inputs, and how each engine is timed on them. Ours is `Engine.generate` (or jobs of `submit_ids`); the peers
(`Peers`: HF `generate`, CTranslate2 `translate_batch`) run the same inputs with the same options,
`min_new_tokens == max_new_tokens`, so every engine decodes the same tokens."""
from __future__ import annotations

import random
import statistics
import threading
import time
import zlib
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import torch

from bench import lora
from bench.ceilings import Shape, floor_seconds, sync
from bench.ct2 import CT2
from bench.report import Result, length_notes, result, with_peer_ratios

FIXED = ["greedy_b16", "greedy_b256", "greedy_b1024", "beam4_b64", "beam4_b256", "latency_greedy", "latency_beam4",
         "sample_b256", "latency_sample", "cpu_b8"]
SAMPLING = dict(top_k=50, top_p=0.9)  # the sampling rows' warpers, ours and the peers'
TGT_LANGS = ["fra_Latn", "deu_Latn", "spa_Latn", "zho_Hans", "arb_Arab", "hin_Deva"]
SRC_LANGS = ["eng_Latn", "por_Latn", "ita_Latn", "rus_Cyrl"]
REPEATS = 3  # timed runs per fixed row and engine; the median is reported (single runs moved 10-20%)


@dataclass
class Spec:
    name: str
    batch: int
    beams: int
    src_len: int
    new_tokens: int
    sample: bool = False  # do_sample with SAMPLING (beams 1)


def fixed_spec(name: str, quick: bool) -> Spec:
    if name == "cpu_b8":
        return Spec(name, 8, 1, 24, 24 if not quick else 4)
    if name.startswith("latency"):
        return Spec(name, 1, 4 if "beam" in name else 1, 20, 20 if not quick else 4, "sample" in name)
    beams = 4 if name.startswith("beam4") else 1
    batch = int(name.rsplit("_b", 1)[1])
    if quick:
        batch = max(1, batch // 256)
    return Spec(name, batch, beams, 32 if not quick else 12, 64 if not quick else 4, "sample" in name)


def workload_spec(name: str, quick: bool) -> Spec:
    """fixed_spec; a LoRA row takes greedy_b256's, with at least one segment per adapter (--quick)."""
    if name not in lora.WORKLOADS:
        return fixed_spec(name, quick)
    base = fixed_spec(lora.SHAPE_WORKLOAD, quick)
    return replace(base, name=name, batch=max(base.batch, lora.WORKLOADS[name][0]))


# ---- inputs --------------------------------------------------------------------------------------
class Vocab:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.first_lang = min(tokenizer.lang_id(c, "lang") for c in SRC_LANGS + TGT_LANGS)

    def source(self, rng: random.Random, length: int, lang: str = "eng_Latn") -> list[int]:
        """`[src_lang] pieces </s>`, `length` tokens in all."""
        hi = max(5, min(self.first_lang, 4000))
        return [self.tok.lang_id(lang, "src_lang")] + [rng.randrange(4, hi) for _ in range(length - 2)] + [2]


def fixed_inputs(spec: Spec, vocab: Vocab) -> tuple[list[list[int]], str, object]:
    """The workload's batch (seeded by its name), target language and GenerationOptions."""
    from engine import GenerationOptions
    rng = random.Random(zlib.crc32(spec.name.encode()))  # not hash(): str hashes change from process to process
    batch = [vocab.source(rng, spec.src_len) for _ in range(spec.batch)]
    opts = GenerationOptions(num_beams=spec.beams, min_new_tokens=spec.new_tokens, max_new_tokens=spec.new_tokens,
                             **(dict(do_sample=True, seed=0, **SAMPLING) if spec.sample else {}))
    return batch, "fra_Latn", opts


# ---- HF ------------------------------------------------------------------------------------------
def load_hf(model_dir: Path, device: str, dtype: torch.dtype):
    from transformers import M2M100ForConditionalGeneration
    try:
        model = M2M100ForConditionalGeneration.from_pretrained(model_dir, dtype=dtype)
    except TypeError:
        model = M2M100ForConditionalGeneration.from_pretrained(model_dir, torch_dtype=dtype)
    return model.to(device).eval()


def hf_generate(model, batch: list[list[int]], forced_id: int, beams: int, new_tokens: int, device: str,
                sample: bool = False):
    width = max(len(s) for s in batch)
    ids = torch.full((len(batch), width), 1, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    with torch.no_grad():
        return model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), num_beams=beams,
                              do_sample=sample, **(SAMPLING if sample else {}), min_new_tokens=new_tokens,
                              max_new_tokens=new_tokens, forced_bos_token_id=forced_id, early_stopping=False,
                              length_penalty=1.0, max_length=None)


# ---- timing --------------------------------------------------------------------------------------
def peak_reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else float("nan")


def timed_run(run: Callable[[], object], device: str) -> tuple[float, object]:
    """Seconds of one run of `run`, ended by a device sync, and its result."""
    t = time.perf_counter()
    out = run()
    sync(device)
    return time.perf_counter() - t, out


def median_time(run: Callable[[], object], device: str) -> tuple[float, object]:
    """Median seconds of REPEATS runs of `run` (each ended by a device sync), and the last run's result."""
    times, out = [], None
    for _ in range(REPEATS):
        seconds, out = timed_run(run, device)
        times.append(seconds)
    return statistics.median(times), out


def alternated_times(first: Callable[[], object], second: Callable[[], object], device: str,
                     pairs: int = 9) -> tuple[float, float]:
    """Median seconds of `first` and of `second` over `pairs` runs of each, taken in turns, so that a machine
    that drifts over the call (a LoRA row's base measured minutes before it moved by ~4%) moves both alike.
    Nine pairs: with five, one row's ratio moved by up to 0.08 between runs of the same code."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(pairs):
        for run, out in ((first, times[0]), (second, times[1])):
            out.append(timed_run(run, device)[0])
    return statistics.median(times[0]), statistics.median(times[1])


def graph_count(eng) -> int:
    """How many CUDA graphs (decode step and prefill) the engine holds (0 without graphs: CPU, or captures failed)."""
    return len(eng.graphs.graphs) + len(eng.prefill.graphs.graphs) if eng.graphs is not None else 0


# ---- peers ---------------------------------------------------------------------------------------
@dataclass
class Peers:
    """The engines ours is compared with (None: not run), each decoding the same sources as ours."""
    device: str
    hf: object | None = None  # M2M100ForConditionalGeneration
    ct2: CT2 | None = None

    def batch_runs(self, batch: Sequence[Sequence[int]], forced_id: int, beams: int, new_tokens: int,
                   sample: bool = False) -> dict[str, Callable[[], object]]:
        """Per peer, a call that decodes `batch` as one batch of exactly `new_tokens` tokens a source
        (inputs prepared here, outside the call)."""
        runs: dict[str, Callable[[], object]] = {}
        if self.hf is not None:
            runs["hf"] = partial(hf_generate, self.hf, list(batch), forced_id, beams, new_tokens, self.device, sample)
        if self.ct2 is not None:
            runs["ct2"] = partial(self.ct2.translate, CT2.sources(batch), forced_id, beams, new_tokens, sample,
                                  len(batch))
        return runs


def decoded_tokens(out: object) -> int:
    """Output tokens a peer's run decoded (the language token included): HF's [B, 1 + new] ids, CT2's results,
    or a list of either (one per batch)."""
    if isinstance(out, torch.Tensor):
        return out.shape[0] * (out.shape[1] - 1)
    if out and hasattr(out[0], "hypotheses"):
        return sum(len(ids) for ids in CT2.output_ids(out))
    return sum(decoded_tokens(x) for x in out)


def peer_results(name: str, runs: dict[str, Callable[[], object]], tokens: int, floor: float,
                 device: str, decoded: int | None = None) -> list[Result]:
    """Each peer's row: warmed up on the timed input itself (HF's first large batch in a process took 2.5-4x its
    usual time), then the median of REPEATS runs. `tokens` counted; a run that decoded other than `decoded`
    (default: `tokens`) says so in its note."""
    decoded = tokens if decoded is None else decoded
    rows = []
    for engine, run in runs.items():
        run()
        peak_reset(device)
        seconds, out = median_time(run, device)
        got = decoded_tokens(out)
        note = "" if got == decoded else f"decoded {got} tokens, {decoded} expected ({tokens} counted)"
        rows.append(result(name, engine, seconds, tokens, floor, peak_gib(device) if engine == "hf" else float("nan"),
                           note=note))
    return rows


# ---- fixed rows ----------------------------------------------------------------------------------
def warm_up_fixed(eng, spec: Spec, batch: list[list[int]], run: Callable[[], object], adapted: bool = False) -> None:
    """The CUDA graphs of every row and token bucket up to the batch's (at its source bound) captured here, not
    inside the timing (a capture costs ~100 ms or more): jobs submitted one by one join the running batch over a
    few steps, at row counts that vary from run to run. Then runs of the timed batch itself (allocator, kernels),
    until one captures nothing new."""
    eng.warm_up(spec.batch * spec.beams, max(map(len, batch)), adapted, beams=spec.beams)
    for _ in range(4):
        before = graph_count(eng)
        run()
        if graph_count(eng) == before:
            break


def run_fixed(spec: Spec, eng, peers: Peers, vocab: Vocab, shape: Shape, ceil: dict, args,
              generate: Callable[..., list] | None = None, adapted: bool = False) -> list[Result]:
    """Warm up on the batch, then time it; `generate(batch, tgt, options)` (default eng.generate) runs it,
    with adapters when `adapted`. Then each peer on the same batch as one batch."""
    generate = generate or eng.generate
    batch, tgt, opts = fixed_inputs(spec, vocab)
    tokens = spec.batch * spec.new_tokens
    elem = 2 if args.device == "cuda" else 4
    floor = floor_seconds(shape, [(spec.src_len, spec.new_tokens, spec.beams)] * spec.batch, ceil, elem)
    def run() -> list:
        return generate(batch, tgt, opts)
    warm_up_fixed(eng, spec, batch, run, adapted)
    before = graph_count(eng)
    peak_reset(args.device)
    ours_s, results = median_time(run, args.device)
    got = sum(len(r.tokens) for r in results)
    expected = tokens - spec.batch
    notes = length_notes(got, expected)
    if graph_count(eng) > before:
        notes.append(f"{graph_count(eng) - before} CUDA graph capture(s) inside the timing")
    out = [result(spec.name, "ours", ours_s, tokens, floor, peak_gib(args.device), note="; ".join(notes))]
    forced = vocab.tok.lang_id(tgt, "tgt_lang")
    out += peer_results(spec.name, peers.batch_runs(batch, forced, spec.beams, spec.new_tokens, spec.sample),
                        tokens, floor, args.device)
    return with_peer_ratios(out)


# ---- the arrival stream --------------------------------------------------------------------------
@dataclass
class Job:
    arrival: float
    segments: list[list[int]]
    tgt: str
    beams: int
    new_tokens: int
    done: float = field(default=0.0)


def make_stream(vocab: Vocab, n_jobs: int, rate: float, quick: bool, seed: int = 0,
                single: bool = False) -> list[Job]:
    """Poisson arrivals at `rate` jobs/s of 1-3 segments (`single`: one) of 5-120 source tokens, greedy or beam 4,
    new tokens the source's bucket, several language pairs."""
    rng = random.Random(seed)
    t, jobs = 0.0, []
    buckets = (4, 8) if quick else (16, 32, 64, 128)
    for _ in range(n_jobs):
        t += rng.expovariate(rate)
        n_seg = 1 if quick or single else rng.choice((1, 1, 1, 2, 3))
        src_len = rng.randint(5, 12 if quick else 120)
        new = min(b for b in buckets if b >= min(src_len, buckets[-1]))
        segs = [vocab.source(rng, max(5, src_len + rng.randint(-3, 3)), rng.choice(SRC_LANGS)) for _ in range(n_seg)]
        jobs.append(Job(t, segs, rng.choice(TGT_LANGS[:3]), rng.choice((1, 1, 4)), new))
    return jobs


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def submit_stream(eng, jobs: list[Job]) -> list[float]:
    """Submit each job at its arrival time (jobs' arrivals counted from now) and wait for all; each job's
    latency in ms, its completion taken by the future's callback."""
    from engine import GenerationOptions
    opts = {(b, n): GenerationOptions(num_beams=b, min_new_tokens=n, max_new_tokens=n)
            for b, n in {(j.beams, j.new_tokens) for j in jobs}}
    lock = threading.Lock()
    pending = []
    t0 = time.perf_counter()
    for j in jobs:
        delay = t0 + j.arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        fut = eng.submit_ids(j.segments, j.tgt, opts[(j.beams, j.new_tokens)])

        def done(_f, job=j):
            with lock:
                job.done = time.perf_counter() - t0
        fut.add_done_callback(done)
        pending.append(fut)
    for f in pending:
        f.result()
    return [(j.done - j.arrival) * 1e3 for j in jobs]


def static_batches(jobs: list[Job], max_segments: int) -> list[list[Job]]:
    """Consecutive jobs (arrival order) with the same (beams, new tokens, target), at most max_segments segments a
    batch, ordered by their last job's arrival."""
    groups: dict[tuple, list[Job]] = {}
    batches: list[list[Job]] = []
    for j in jobs:
        key = (j.beams, j.new_tokens, j.tgt)
        g = groups.setdefault(key, [])
        if sum(len(x.segments) for x in g) + len(j.segments) > max_segments:
            batches.append(g)
            g = groups[key] = []
        g.append(j)
    batches += [g for g in groups.values() if g]
    return sorted(batches, key=lambda g: g[-1].arrival)


def run_stream(eng, peers: Peers, vocab: Vocab, shape: Shape, ceil: dict, args) -> list[Result]:
    """Jobs arriving over time: ours takes them as they arrive (continuous batching); each peer runs static
    batches of the same jobs in arrival order on a simulated timeline (a batch starts when its last job has
    arrived and the device is free). Throughput and p50/p99 job latency."""
    jobs = make_stream(vocab, args.stream_jobs, args.stream_rate, args.quick)
    tokens = sum(len(j.segments) * j.new_tokens for j in jobs)
    elem = 2 if args.device == "cuda" else 4
    floor = floor_seconds(shape, [(len(s), j.new_tokens, j.beams) for j in jobs for s in j.segments], ceil, elem)
    peak_reset(args.device)
    lat = submit_stream(eng, jobs)
    wall = max(j.done for j in jobs) - jobs[0].arrival
    out = [result("stream", "ours", wall, tokens, floor, peak_gib(args.device), p50_ms=percentile(lat, 50),
                  p99_ms=percentile(lat, 99), note=f"{len(jobs)} jobs at {args.stream_rate}/s")]
    batches = static_batches(jobs, args.hf_batch)
    for engine in ("hf", "ct2"):
        peak_reset(args.device)
        free_at, peer_lat, end = 0.0, [], 0.0
        for g in batches:
            segs = [s for j in g for s in j.segments]
            runs = peers.batch_runs(segs, vocab.tok.lang_id(g[0].tgt, "tgt_lang"), g[0].beams, g[0].new_tokens)
            if engine not in runs:
                break
            dur, _ = timed_run(runs[engine], args.device)
            end = free_at = max(free_at, g[-1].arrival) + dur
            peer_lat += [(end - j.arrival) * 1e3 for j in g]
        if peer_lat:
            out.append(result("stream", engine, end - jobs[0].arrival, tokens, floor,
                              peak_gib(args.device) if engine == "hf" else float("nan"),
                              p50_ms=percentile(peer_lat, 50), p99_ms=percentile(peer_lat, 99),
                              note=f"{len(batches)} static batches"))
    return with_peer_ratios(out)
