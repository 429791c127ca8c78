"""Benchmark harness: this engine vs HF `generate` on a random NLLB-shaped checkpoint, one process.

    python3 -m bench.run --out OUT [--shape 600M|1.3B|3.3B] [--workloads a,b,...] [--skip-hf]
    python3 -m bench.run --device cpu --shape tiny --quick --out /tmp/bench   # smoke test, seconds

1. writes a random checkpoint of the shape (bench/checkpoint.py), bf16 on CUDA;
2. measures the device's copy bandwidth and matmul rate (the two ceilings);
3. runs each workload with our engine and with HF `M2M100ForConditionalGeneration.generate`
   (same inputs and options, `min_new_tokens == max_new_tokens`, `forced_bos_token_id`), each
   warmed up on the timed batch, then timed REPEATS times (the median is reported): time,
   output tokens/s, ratio to HF, percent of the floor (per decode step max(bytes / bandwidth,
   FLOPs / matmul rate), summed over the steps, plus the encoder), peak GPU memory;
4. writes results.md and results.json to --out (after every workload, so a cut run keeps its rows).

Workloads (source 32 tokens, 64 new tokens unless named otherwise):
  greedy_b16, greedy_b256, greedy_b1024    batch greedy
  greedy_b256_jobs                         greedy_b256 as 256 one-segment jobs, no adapter: the LoRA rows' base
  greedy_b256_lora1, _lora8, _lora32       the same, job i on adapter i % N of N random rank-16 adapters
                                           (bench/lora.py); ratio to the same jobs without adapters (runs
                                           taken in turns); no HF
  greedy_b256_lora32qv                     the same with 32 adapters of q_proj/v_proj only (PEFT's BART default)
  beam4_b64, beam4_b256                    batch beam search, 4 beams
  latency_greedy, latency_beam4            one sentence, 20 -> 20 tokens
  sample_b256, latency_sample              sampling (top-k 50, top-p 0.9: the processor kernels), batch and one
                                           sentence
  stream                                   jobs arriving over time (Poisson), 5-120 source tokens,
                                           greedy and beam 4, several language pairs; our engine
                                           takes them as they arrive (continuous batching), HF runs
                                           static batches of the same jobs in arrival order (simulated
                                           timeline: a batch starts when its last job arrived and the
                                           GPU is free); throughput and p50/p99 job latency.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import random
import shutil
import sys
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from bench import lora

FIXED = ["greedy_b16", "greedy_b256", "greedy_b1024", "beam4_b64", "beam4_b256", "latency_greedy", "latency_beam4",
         "sample_b256", "latency_sample"]
SAMPLING = dict(top_k=50, top_p=0.9)  # the sampling rows' warpers, ours and HF's
ALL_WORKLOADS = FIXED + list(lora.WORKLOADS) + ["stream"]
TGT_LANGS = ["fra_Latn", "deu_Latn", "spa_Latn", "zho_Hans", "arb_Arab", "hin_Deva"]
SRC_LANGS = ["eng_Latn", "por_Latn", "ita_Latn", "rus_Cyrl"]


@dataclass
class Spec:
    name: str
    batch: int
    beams: int
    src_len: int
    new_tokens: int
    sample: bool = False  # do_sample with SAMPLING (beams 1)


def fixed_spec(name: str, quick: bool) -> Spec:
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


@dataclass
class Result:
    workload: str
    engine: str  # "ours" or "hf"
    seconds: float
    tokens: int  # output tokens (best hypothesis per segment), the same count for both engines
    tokens_per_s: float
    floor_seconds: float
    pct_of_floor: float
    peak_mem_gib: float
    ratio_to_hf: float | None = None  # ours tokens/s over HF tokens/s
    ratio_to_base: float | None = None  # LoRA rows: tokens/s over the same jobs' without adapters (runs in turns)
    p50_ms: float | None = None
    p99_ms: float | None = None
    note: str = ""


# ---- ceilings and the floor ---------------------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_ceilings(device: str, quick: bool) -> dict:
    """Copy bandwidth (bytes read + written per second) and the matmul rate of the run dtype."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n_bytes = (1 << 30) if device == "cuda" else (64 << 20)
    a = torch.empty(n_bytes // 4, dtype=torch.float32, device=device).uniform_()
    b = torch.empty_like(a)
    m = 8192 if device == "cuda" else (512 if quick else 1024)
    x = torch.randn(m, m, device=device).to(dtype)
    y = torch.randn(m, m, device=device).to(dtype)

    def timed(fn, reps):
        fn()
        sync(device)
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        return (time.perf_counter() - t) / reps

    copy_s = timed(lambda: b.copy_(a), 10)
    mm_s = timed(lambda: x @ y, 10 if device == "cuda" else 2)
    return {"copy_bytes_per_s": 2 * n_bytes / copy_s, "matmul_flops_per_s": 2 * m ** 3 / mm_s,
            "matmul_dtype": str(dtype)}


@dataclass
class Shape:
    d: int
    enc_layers: int
    dec_layers: int
    ffn: int
    vocab: int
    heads: int

    @classmethod
    def from_config(cls, cfg: dict) -> "Shape":
        return cls(cfg["d_model"], cfg["encoder_layers"], cfg["decoder_layers"], cfg["decoder_ffn_dim"],
                   cfg["vocab_size"], cfg["decoder_attention_heads"])

    def enc_params(self) -> int:
        return self.enc_layers * (4 * self.d * self.d + 2 * self.d * self.ffn)

    def dec_params(self) -> int:  # per decode step: decoder layers (self q/k/v/o, cross q/o, ffn) + LM head
        return self.dec_layers * (6 * self.d * self.d + 2 * self.d * self.ffn) + self.vocab * self.d


def floor_seconds(shape: Shape, segments: list[tuple[int, int, int]], ceil: dict, elem: int) -> float:
    """Sum over decode steps of max(bytes / bandwidth, FLOPs / matmul rate), plus the encoder pass.
    segments: (source length, new tokens, beams) per segment, all decoded together."""
    bw, rate = ceil["copy_bytes_per_s"], ceil["matmul_flops_per_s"]
    d, L = shape.d, shape.dec_layers
    src_tokens = sum(s for s, _, _ in segments)
    enc_flops = 2 * src_tokens * (shape.enc_params() + 2 * shape.dec_layers * d * d)  # + cross K/V projections
    total = max(shape.enc_params() * elem / bw, enc_flops / rate)
    for step in range(max(n for _, n, _ in segments)):
        live = [(s, b) for s, n, b in segments if step < n]
        rows = sum(b for _, b in live)
        kv_bytes = sum(L * 2 * d * elem * (b * (step + 1) + s) for s, b in live)
        attn_flops = sum(4 * L * d * b * (step + 1 + s) for s, b in live)
        w_bytes = shape.dec_params() * elem
        total += max((w_bytes + kv_bytes) / bw, (2 * rows * shape.dec_params() + attn_flops) / rate)
    return total


# ---- inputs --------------------------------------------------------------------------------------
class Vocab:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.first_lang = min(tokenizer.lang_id(c, "lang") for c in SRC_LANGS + TGT_LANGS)

    def source(self, rng: random.Random, length: int, lang: str = "eng_Latn") -> list[int]:
        """`[src_lang] pieces </s>`, `length` tokens in all."""
        hi = max(5, min(self.first_lang, 4000))
        return [self.tok.lang_id(lang, "src_lang")] + [rng.randrange(4, hi) for _ in range(length - 2)] + [2]


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


# ---- runners -------------------------------------------------------------------------------------
def peak_reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else float("nan")


REPEATS = 3  # timed runs per fixed row and engine; the median is reported (single runs moved 10-20%)


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


def graph_count(eng) -> int:
    """How many CUDA graphs (decode step and prefill) the engine holds (0 without graphs: CPU, or captures failed)."""
    return len(eng.graphs.graphs) + len(eng.prefill.graphs.graphs) if eng.graphs is not None else 0


def fixed_inputs(spec: Spec, vocab: Vocab) -> tuple[list[list[int]], str, object]:
    """The workload's batch (seeded by its name), target language and GenerationOptions."""
    from engine import GenerationOptions
    rng = random.Random(hash(spec.name) & 0xffff)
    batch = [vocab.source(rng, spec.src_len) for _ in range(spec.batch)]
    opts = GenerationOptions(num_beams=spec.beams, min_new_tokens=spec.new_tokens, max_new_tokens=spec.new_tokens,
                             **(dict(do_sample=True, seed=0, **SAMPLING) if spec.sample else {}))
    return batch, "fra_Latn", opts


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


def run_fixed(spec: Spec, eng, hf, vocab: Vocab, shape: Shape, ceil: dict, args,
              generate: Callable[..., list] | None = None, adapted: bool = False) -> list[Result]:
    """Warm up on the batch, then time it; `generate(batch, tgt, options)` (default eng.generate) runs it,
    with adapters when `adapted`."""
    generate = generate or eng.generate
    batch, tgt, opts = fixed_inputs(spec, vocab)
    tokens = spec.batch * spec.new_tokens
    elem = 2 if args.device == "cuda" else 4
    floor = floor_seconds(shape, [(spec.src_len, spec.new_tokens, spec.beams)] * spec.batch, ceil, elem)
    out = []
    # warm-up: the CUDA graphs of every row and token bucket up to the batch's (at its source bound) are captured
    # here, not inside the timing (a capture costs ~100 ms or more): jobs submitted one by one join the
    # running batch over a few steps, at row counts that vary from run to run. Then runs of the timed
    # batch itself (allocator, kernels), until one captures nothing new.
    eng.warm_up(spec.batch * spec.beams, max(map(len, batch)), adapted)
    for _ in range(4):
        before = graph_count(eng)
        generate(batch, tgt, opts)
        if graph_count(eng) == before:
            break
    before = graph_count(eng)
    peak_reset(args.device)
    ours_s, results = median_time(lambda: generate(batch, tgt, opts), args.device)
    got = sum(len(r.tokens) for r in results)
    expected = tokens - spec.batch
    notes = [] if got == expected else [f"ours produced {got} tokens (expected {expected} + lang)"]
    if graph_count(eng) > before:
        notes.append(f"{graph_count(eng) - before} CUDA graph capture(s) inside the timing")
    note = "; ".join(notes)
    out.append(Result(spec.name, "ours", ours_s, tokens, tokens / ours_s, floor, 100 * floor / ours_s,
                      peak_gib(args.device), note=note))
    if hf is not None:
        forced = vocab.tok.lang_id(tgt, "tgt_lang")
        # HF warms up on the timed batch too: on 2 sentences only, its first large-batch run in a process
        # took 2.5-4x its usual time
        hf_args = (hf, batch, forced, spec.beams, spec.new_tokens, args.device, spec.sample)
        hf_generate(*hf_args)
        peak_reset(args.device)
        hf_s, _ = median_time(lambda: hf_generate(*hf_args), args.device)
        out.append(Result(spec.name, "hf", hf_s, tokens, tokens / hf_s, floor, 100 * floor / hf_s,
                          peak_gib(args.device)))
        out[0].ratio_to_hf = out[0].tokens_per_s / out[1].tokens_per_s
    return out


def run_lora(spec: Spec, eng, vocab: Vocab, shape: Shape, ceil: dict, args) -> list[Result]:
    """A greedy_b256_loraN row (bench/lora.py): adapters made resident first, then run_fixed without HF; its
    ratio to the no-adapter row from the row's batch with and without its adapters, runs in turns."""
    names = lora.row_names(spec.name)
    lora.make_resident(eng, names, vocab.source(random.Random(0), 8), "fra_Latn")
    rows = run_fixed(spec, eng, None, vocab, shape, ceil, args, partial(lora.generate_mixed, eng, names=names),
                     adapted=names != [None])
    times = None
    if names != [None]:
        batch, tgt, opts = fixed_inputs(spec, vocab)
        times = alternated_times(lambda: lora.generate_mixed(eng, batch, tgt, opts, [None]),
                                 lambda: lora.generate_mixed(eng, batch, tgt, opts, names), args.device)
    for r in rows:
        r.ratio_to_base = times[0] / times[1] if times else None
        r.note = "; ".join(filter(None, [lora.note(spec.name, times), r.note]))
    return rows


@dataclass
class Job:
    arrival: float
    segments: list[list[int]]
    tgt: str
    beams: int
    new_tokens: int
    done: float = field(default=0.0)


def make_stream(vocab: Vocab, n_jobs: int, rate: float, quick: bool, seed: int = 0) -> list[Job]:
    rng = random.Random(seed)
    t, jobs = 0.0, []
    buckets = (4, 8) if quick else (16, 32, 64, 128)
    for _ in range(n_jobs):
        t += rng.expovariate(rate)
        n_seg = 1 if quick else rng.choice((1, 1, 1, 2, 3))
        src_len = rng.randint(5, 12 if quick else 120)
        new = min(b for b in buckets if b >= min(src_len, buckets[-1]))
        segs = [vocab.source(rng, max(5, src_len + rng.randint(-3, 3)), rng.choice(SRC_LANGS)) for _ in range(n_seg)]
        jobs.append(Job(t, segs, rng.choice(TGT_LANGS[:3]), rng.choice((1, 1, 4)), new))
    return jobs


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def run_stream(eng, hf, vocab: Vocab, shape: Shape, ceil: dict, args) -> list[Result]:
    from engine import GenerationOptions
    jobs = make_stream(vocab, args.stream_jobs, args.stream_rate, args.quick)
    tokens = sum(len(j.segments) * j.new_tokens for j in jobs)
    elem = 2 if args.device == "cuda" else 4
    floor = floor_seconds(shape, [(len(s), j.new_tokens, j.beams) for j in jobs for s in j.segments], ceil, elem)
    opts = {(b, n): GenerationOptions(num_beams=b, min_new_tokens=n, max_new_tokens=n)
            for b, n in {(j.beams, j.new_tokens) for j in jobs}}
    peak_reset(args.device)
    lock = threading.Lock()
    pending = []
    t0 = time.perf_counter()
    for j in jobs:  # submit each job at its arrival time; completion recorded by the future's callback
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
    wall = max(j.done for j in jobs) - jobs[0].arrival
    lat = [(j.done - j.arrival) * 1e3 for j in jobs]
    out = [Result("stream", "ours", wall, tokens, tokens / wall, floor, 100 * floor / wall, peak_gib(args.device),
                  p50_ms=percentile(lat, 50), p99_ms=percentile(lat, 99),
                  note=f"{len(jobs)} jobs at {args.stream_rate}/s")]
    if hf is not None:
        # static batches: consecutive jobs (arrival order) with the same (beams, new tokens, target), at
        # most --hf-batch segments; a batch starts when its last job has arrived and the GPU is free.
        groups: dict[tuple, list[Job]] = {}
        batches: list[list[Job]] = []
        for j in jobs:
            key = (j.beams, j.new_tokens, j.tgt)
            g = groups.setdefault(key, [])
            if sum(len(x.segments) for x in g) + len(j.segments) > args.hf_batch:
                batches.append(g)
                g = groups[key] = []
            g.append(j)
        batches += [g for g in groups.values() if g]
        batches.sort(key=lambda g: g[-1].arrival)
        peak_reset(args.device)
        free_at, hf_lat, end = 0.0, [], 0.0
        for g in batches:
            segs = [s for j in g for s in j.segments]
            forced = vocab.tok.lang_id(g[0].tgt, "tgt_lang")
            dur, _ = timed_run(lambda: hf_generate(hf, segs, forced, g[0].beams, g[0].new_tokens, args.device),
                               args.device)
            start = max(free_at, g[-1].arrival)
            end = free_at = start + dur
            hf_lat += [(end - j.arrival) * 1e3 for j in g]
        wall_hf = end - jobs[0].arrival
        out.append(Result("stream", "hf", wall_hf, tokens, tokens / wall_hf, floor, 100 * floor / wall_hf,
                          peak_gib(args.device), p50_ms=percentile(hf_lat, 50), p99_ms=percentile(hf_lat, 99),
                          note=f"{len(batches)} static batches"))
        out[0].ratio_to_hf = out[0].tokens_per_s / out[1].tokens_per_s
    return out


# ---- checkpoint ------------------------------------------------------------------------------------
def make_checkpoint(out_dir: Path, shape: str, dtype: torch.dtype) -> Path:
    """A random checkpoint of the NLLB shape under out_dir (reused when already there)."""
    from bench.checkpoint import write_random_checkpoint

    ckpt = out_dir / f"ckpt-{shape}"
    if not (ckpt / "config.json").exists():
        write_random_checkpoint(ckpt, shape, dtype=dtype)
    return ckpt


# ---- report --------------------------------------------------------------------------------------
def markdown(results: list[Result], meta: dict) -> str:
    lines = [f"# bench: {meta['shape']} on {meta['device_name']}", "",
             f"copy bandwidth {meta['ceilings']['copy_bytes_per_s'] / 1e9:.0f} GB/s, "
             f"matmul {meta['ceilings']['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s "
             f"({meta['ceilings']['matmul_dtype']}); "
             f"command: `{meta['command']}`", "",
             "| workload | engine | time s | tokens | tokens/s | vs HF | % of floor | p50 ms | p99 ms | peak GiB "
             "| note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x, fmt: "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)  # noqa: E731
    for r in results:
        lines.append(f"| {r.workload} | {r.engine} | {r.seconds:.3f} | {r.tokens} | {r.tokens_per_s:.0f} | "
                     f"{f(r.ratio_to_hf, '.2f')} | {r.pct_of_floor:.1f} | {f(r.p50_ms, '.0f')} | "
                     f"{f(r.p99_ms, '.0f')} | "
                     f"{f(r.peak_mem_gib, '.2f')} | {r.note} |")
    return "\n".join(lines) + "\n"


def run_workload(name: str, eng, hf, vocab: Vocab, shape: Shape, ceil: dict, args) -> list[Result]:
    """Dispatch one workload by name."""
    if name == "stream":
        return run_stream(eng, hf, vocab, shape, ceil, args)
    if name in lora.WORKLOADS:
        return run_lora(workload_spec(name, args.quick), eng, vocab, shape, ceil, args)
    return run_fixed(fixed_spec(name, args.quick), eng, hf, vocab, shape, ceil, args)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("engine").setLevel(logging.INFO)  # graph captures and adapter loads, in the log
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="600M", choices=["tiny", "600M", "1.3B", "3.3B"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--workloads", default=",".join(ALL_WORKLOADS), help=f"comma list of {ALL_WORKLOADS}")
    p.add_argument("--skip-hf", action="store_true", help="our engine only")
    p.add_argument("--quick", action="store_true", help="tiny batches and few tokens (smoke test)")
    p.add_argument("--model-dir", type=Path, help="an existing checkpoint instead of a random one")
    p.add_argument("--stream-jobs", type=int, default=None)
    p.add_argument("--stream-rate", type=float, default=None, help="jobs per second")
    p.add_argument("--hf-batch", type=int, default=128, help="HF static batch size (segments) in the stream")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip workloads once this much time has passed")
    args = p.parse_args(argv)
    args.stream_jobs = args.stream_jobs or (4 if args.quick else 160)
    args.stream_rate = args.stream_rate or (40.0 if args.quick else 40.0)
    names = lora.with_base([w.strip() for w in args.workloads.split(",") if w.strip()])
    unknown = set(names) - set(ALL_WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; choose from {ALL_WORKLOADS}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no GPU; use --device cpu --shape tiny --quick for a smoke test")
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model_dir = args.model_dir or make_checkpoint(args.out, args.shape, dtype)
    print(f"checkpoint {model_dir} ready after {time.perf_counter() - started:.1f}s", flush=True)
    ceil = measure_ceilings(args.device, args.quick)
    print(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s, matmul {ceil['matmul_flops_per_s'] / 1e12:.2f} "
          f"TFLOP/s", flush=True)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    shape = Shape.from_config(cfg)

    from engine import Engine
    specs = [workload_spec(n, args.quick) for n in names if n != "stream"]
    max_rows = max([s.batch * s.beams for s in specs] + [64 if "stream" in names else 1])
    lora_options = lora.engine_options(names, model_dir)  # one engine for every row, adapters or not
    eng = Engine.load(model_dir, device=args.device, max_rows=max_rows, **lora_options)
    vocab = Vocab(eng.tokenizer)
    hf = None if args.skip_hf else load_hf(Path(model_dir), args.device, dtype)
    if hf is not None:  # warm HF up once at a mid-size batch (kernels, allocator), as our engine is below
        hf_generate(hf, [vocab.source(random.Random(1), 32) for _ in range(16)], vocab.tok.lang_id("fra_Latn", "tgt"),
                    1, 4, args.device)
    meta = {"shape": args.shape, "device": args.device,
            "command": " ".join(["python3 -m bench.run"] + (argv or sys.argv[1:])),
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__, "ceilings": ceil, "max_rows": max_rows,
            "ops": getattr(eng.backend.ops, "__name__", "?"), "lora": {k: str(v) for k, v in lora_options.items()}}
    results: list[Result] = []
    try:
        for name in names:
            if time.perf_counter() - started > args.budget_s:
                print(f"skipping {name}: past --budget-s {args.budget_s}", flush=True)
                continue
            rs = run_workload(name, eng, hf, vocab, shape, ceil, args)
            results += rs
            for r in rs:
                print(f"{r.workload:<18} {r.engine:<5} {r.seconds:8.3f}s {r.tokens_per_s:10.0f} tok/s "
                      f"floor {r.pct_of_floor:5.1f}%  peak {r.peak_mem_gib:.2f} GiB"
                      + (f"  x{r.ratio_to_hf:.2f} vs HF" if r.ratio_to_hf else "")
                      + (f"  x{r.ratio_to_base:.2f} vs no-adapter" if r.ratio_to_base else "")
                      + (f"  p50 {r.p50_ms:.0f} ms p99 {r.p99_ms:.0f} ms" if r.p50_ms is not None else ""), flush=True)
            (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]},
                                                              indent=1))
            (args.out / "results.md").write_text(markdown(results, meta))
    finally:
        eng.close()
        if lora_options:
            shutil.rmtree(lora_options["adapters_dir"], ignore_errors=True)
    print(markdown(results, meta))
    if args.model_dir is None and not args.quick and args.device == "cuda":
        shutil.rmtree(model_dir, ignore_errors=True)  # GBs; $OUT must stay small
    return 0


if __name__ == "__main__":
    sys.exit(main())
