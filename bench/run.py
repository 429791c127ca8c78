"""Benchmark harness: this engine vs HF `generate` and CTranslate2 on a random NLLB-shaped checkpoint, one process.

    python3 -m bench.run --out OUT [--shape 600M|1.3B|3.3B] [--workloads a,b,...] [--skip-hf] [--skip-ct2]
    python3 -m bench.run --device cpu --shape tiny --quick --out /tmp/bench   # smoke test, seconds

1. writes a random checkpoint of the shape (bench/checkpoint.py), bf16 on CUDA;
2. measures the device's copy bandwidth and matmul rate (the two ceilings);
3. runs each workload with our engine, with HF `M2M100ForConditionalGeneration.generate` and, when
   `import ctranslate2` works, with CTranslate2 4.x `Translator.translate_batch` on the checkpoint
   converted by its own M2M100 loader (bench/ct2.py; bf16 on CUDA, float32 on the CPU): same inputs
   and options, `min_new_tokens == max_new_tokens` (CT2: min == max decoding length), the forced
   target-language token; each warmed up on the timed batch, then timed REPEATS times (the median is
   reported): time, output tokens/s, ratio to HF and to CT2, percent of the floor (per decode step
   max(bytes / bandwidth, FLOPs / matmul rate), summed over the steps, plus the encoder), peak GPU
   memory (torch's: none for CT2);
4. writes results.md and results.json to --out (after every workload, so a cut run keeps its rows).
Once every model is loaded the process takes the worker's collector settings (engine/heap.py settle_heap: what
is loaded frozen, young passes every 50,000 net allocations), for every peer alike: with the default settings
the engine's jobs paid for full passes over HF's and CTranslate2's objects too.

Workloads (source 32 tokens, 64 new tokens unless named otherwise):
  greedy_b16, greedy_b256, greedy_b1024    batch greedy
  greedy_b256_jobs                         greedy_b256 as 256 one-segment jobs, no adapter: the LoRA rows' base
  greedy_b256_lora1, _lora8, _lora32       the same, job i on adapter i % N of N random rank-16 adapters
                                           (bench/lora.py); ratio to the same jobs without adapters (runs
                                           taken in turns); no HF, no CT2
  greedy_b256_lora32qv                     the same with 32 adapters of q_proj/v_proj only (PEFT's BART default)
  beam4_b64, beam4_b256                    batch beam search, 4 beams
  latency_greedy, latency_beam4            one sentence, 20 -> 20 tokens
  sample_b256, latency_sample              sampling (top-k 50, top-p 0.9: the processor kernels), batch and one
                                           sentence
  cpu_b8                                   greedy, 8 sentences, 24 -> 24 tokens: the CPU path's row
                                           (--device cpu; CTranslate2 runs float32 there)
  stream                                   jobs arriving over time (Poisson), 5-120 source tokens,
                                           greedy and beam 4, several language pairs; our engine
                                           takes them as they arrive (continuous batching), HF and
                                           CT2 run static batches of the same jobs in arrival order
                                           (simulated timeline: a batch starts when its last job arrived
                                           and the GPU is free); throughput and p50/p99 job latency.
  corpus_greedy, corpus_beam4              a user's corpus (bench/corpus.py): 4,096 (beam 4: 1,024) sentences,
                                           log-normal source lengths around 26 tokens, each its own output
                                           length 0.8-1.3x its source; ours one job per sentence, all at once;
                                           HF and CT2 sorted by length in batches of 256, each batch as long as
                                           its longest output
  document, document_stream                a 2,000-sentence document as one job against its sentences as
                                           2,000 jobs; single-sentence jobs arriving beside a document, their
                                           p99 against without it (bench/documents.py); ours only
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from bench import corpus, ct2, documents, lora
from bench.ceilings import Shape, measure_ceilings
from bench.checkpoint import shape_name, write_random_checkpoint
from bench.report import Result, console_line, markdown
from bench.workloads import (FIXED, Peers, Spec, Vocab, alternated_times, fixed_inputs, load_hf,
                             run_fixed, run_stream, workload_spec)

ALL_WORKLOADS = FIXED + list(lora.WORKLOADS) + ["stream"] + list(corpus.WORKLOADS) + list(documents.WORKLOADS)


def run_lora(spec: Spec, eng, vocab: Vocab, shape: Shape, ceil: dict, args) -> list[Result]:
    """A greedy_b256_loraN row (bench/lora.py): adapters made resident first, then run_fixed without peers; its
    ratio to the no-adapter row from the row's batch with and without its adapters, runs in turns."""
    names = lora.row_names(spec.name)
    lora.make_resident(eng, names, vocab.source(random.Random(0), 8), "fra_Latn")
    rows = run_fixed(spec, eng, Peers(args.device), vocab, shape, ceil, args,
                     partial(lora.generate_mixed, eng, names=names), adapted=names != [None])
    times = None
    if names != [None]:
        batch, tgt, opts = fixed_inputs(spec, vocab)
        times = alternated_times(lambda: lora.generate_mixed(eng, batch, tgt, opts, [None]),
                                 lambda: lora.generate_mixed(eng, batch, tgt, opts, names), args.device)
    for r in rows:
        r.ratio_to_base = times[0] / times[1] if times else None
        r.note = "; ".join(filter(None, [lora.note(spec.name, times), r.note]))
    return rows


def make_checkpoint(out_dir: Path, shape: str, dtype: torch.dtype) -> Path:
    """A random checkpoint of the NLLB shape under out_dir (reused when already there)."""
    ckpt = out_dir / f"ckpt-{shape}"
    if not (ckpt / "config.json").exists():
        write_random_checkpoint(ckpt, shape, dtype=dtype)
    return ckpt


def run_workload(name: str, eng, peers: Peers, vocab: Vocab, shape: Shape, ceil: dict, args,
                 model_dir: Path) -> list[Result]:
    """Dispatch one workload by name."""
    if name == "document":
        return documents.run_document(eng, model_dir, shape, ceil, args)
    if name == "document_stream":
        return documents.run_document_stream(eng, vocab, model_dir, shape, ceil, args)
    if name == "stream":
        return run_stream(eng, peers, vocab, shape, ceil, args)
    if name in corpus.WORKLOADS:
        return corpus.run_corpus(name, eng, peers, vocab, shape, ceil, args)
    if name in lora.WORKLOADS:
        return run_lora(workload_spec(name, args.quick), eng, vocab, shape, ceil, args)
    return run_fixed(workload_spec(name, args.quick), eng, peers, vocab, shape, ceil, args)


def engine_rows(names: list[str], quick: bool) -> int:
    """The engine's rows: the widest batch of a fixed row (beams counted), 64 for the stream, corpus.ROWS (--quick:
    16) for a corpus or document row."""
    specs = [workload_spec(n, quick) for n in names if n in FIXED or n in lora.WORKLOADS]
    corpus_rows = (16 if quick else corpus.ROWS) if set(names) & {*corpus.WORKLOADS, *documents.WORKLOADS} else 1
    return max([s.batch * s.beams for s in specs] + [64 if "stream" in names else 1, corpus_rows])


def load_peers(model_dir: Path, vocab: Vocab, args, dtype: torch.dtype) -> tuple[Peers, str | None]:
    """HF (unless --skip-hf) and CTranslate2 (unless --skip-ct2, when importable), each warmed up once at a
    mid-size batch (kernels, allocator) as our engine is in each row; and what the run says of CT2."""
    peers = Peers(args.device)
    if not args.skip_hf:
        peers.hf = load_hf(model_dir, args.device, dtype)
    ct2_said = "skipped (--skip-ct2)" if args.skip_ct2 else None
    if not args.skip_ct2:
        error = ct2.import_error()
        if error is None:
            import ctranslate2
            peers.ct2 = ct2.CT2.load(model_dir, args.device)
            ct2_said = f"{ctranslate2.__version__} {ct2.compute_type(args.device)}"
        else:
            ct2_said = f"not importable ({error})"
            print(f"CTranslate2 not run: {error}", flush=True)
    warm = [vocab.source(random.Random(1), 32) for _ in range(16)]
    for run in peers.batch_runs(warm, vocab.tok.lang_id("fra_Latn", "tgt"), 1, 4).values():
        run()
    return peers, ct2_said


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The command line, and the workloads it names (LoRA rows with their base row: lora.with_base)."""
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="600M", choices=["tiny", "600M", "1.3B", "3.3B"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--workloads", default=",".join(ALL_WORKLOADS), help=f"comma list of {ALL_WORKLOADS}")
    p.add_argument("--skip-hf", action="store_true", help="no HF generate rows")
    p.add_argument("--skip-ct2", action="store_true", help="no CTranslate2 rows (else run when importable)")
    p.add_argument("--quick", action="store_true", help="tiny batches and few tokens (smoke test)")
    p.add_argument("--model-dir", type=Path, help="an existing checkpoint instead of a random one")
    p.add_argument("--stream-jobs", type=int, default=None)
    p.add_argument("--stream-rate", type=float, default=None, help="jobs per second")
    p.add_argument("--hf-batch", type=int, default=128, help="peers' static batch size (segments) in the stream")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip workloads once this much time has passed")
    args = p.parse_args(argv)
    args.stream_jobs = args.stream_jobs or (4 if args.quick else 160)
    args.stream_rate = args.stream_rate or 40.0
    names = lora.with_base([w.strip() for w in args.workloads.split(",") if w.strip()])
    unknown = set(names) - set(ALL_WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; choose from {ALL_WORKLOADS}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no GPU; use --device cpu --shape tiny --quick for a smoke test")
    return args, names


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("engine").setLevel(logging.INFO)  # graph captures and adapter loads, in the log
    args, names = parse_args(argv)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model_dir = args.model_dir or make_checkpoint(args.out, args.shape, dtype)
    print(f"checkpoint {model_dir} ready after {time.perf_counter() - started:.1f}s", flush=True)
    ceil = measure_ceilings(args.device, args.quick)
    print(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s, matmul {ceil['matmul_flops_per_s'] / 1e12:.2f} "
          f"TFLOP/s", flush=True)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shape = Shape.from_config(config)

    from engine import Engine
    from engine.heap import settle_heap
    max_rows = engine_rows(names, args.quick)
    lora_options = lora.engine_options(names, model_dir)  # one engine for every row, adapters or not
    eng = Engine.load(model_dir, device=args.device, max_rows=max_rows, **lora_options)
    vocab = Vocab(eng.tokenizer)
    peers, ct2_said = load_peers(Path(model_dir), vocab, args, dtype)
    settle_heap()  # the worker's collector settings, for every peer alike (engine/heap.py)
    meta = {"shape": shape_name(config), "device": args.device,
            "command": " ".join(["python3 -m bench.run"] + (argv or sys.argv[1:])),
            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__, "ceilings": ceil, "max_rows": max_rows, "ct2": ct2_said,
            "ops": getattr(eng.backend.ops, "__name__", "?"), "lora": {k: str(v) for k, v in lora_options.items()}}
    results: list[Result] = []
    try:
        for name in names:
            if time.perf_counter() - started > args.budget_s:
                print(f"skipping {name}: past --budget-s {args.budget_s}", flush=True)
                continue
            rows = run_workload(name, eng, peers, vocab, shape, ceil, args, Path(model_dir))
            results += rows
            for r in rows:
                print(console_line(r), flush=True)
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
