"""Where a step's time goes: engine phases timed with a device sync around each (so GPU time is
attributed to the phase that queued it), then, with --kernels, one more run per workload under
torch.profiler: GPU time per kernel (graph replays included), written to OUT/kernels_<workload>.txt.
Not a throughput benchmark: the syncs cost time too.

    python3 -m bench.profile_steps --out OUT [--model-dir DIR] [--kernels]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import torch

import engine.engine as engine_module
from engine import Engine, GenerationOptions
from tests.fixtures.random_checkpoint import write_random_checkpoint

PHASES = ["_prefill", "_decode_batch", "_execute", "select", "_update"]  # select runs inside _update
WORKLOADS = {"latency_greedy": (1, 1, 20, 20), "greedy_b1024": (1024, 1, 32, 64), "beam4_b256": (256, 4, 32, 64)}


def instrument(eng: Engine, totals: dict[str, float]) -> None:
    """Wrap each phase with a synchronising timer (select is module-level, the rest are methods)."""
    def timed(name, fn):
        def wrapper(*args, **kwargs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            totals[name] += time.perf_counter() - start
            return out
        return wrapper
    for name in PHASES:
        if name == "select":
            engine_module.select = timed(name, engine_module.select)
        else:
            setattr(eng, name, timed(name, getattr(eng, name)))


def kernel_table(eng: Engine, ids: list[list[int]], opts: GenerationOptions, steps: int) -> str:
    """GPU time per kernel name over one generate call, per decode step, largest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.generate(ids, "fra_Latn", opts)
    rows = [(e.self_device_time_total, e.count, e.key) for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]  # kernels and copies only
    rows.sort(reverse=True)
    total = sum(t for t, _, _ in rows)
    lines = [f"GPU busy {total / 1e3:.2f} ms over {steps} steps = {total / steps / 1e3:.3f} ms/step",
             f"{'us/step':>9} {'calls/step':>10}  name"]
    lines += [f"{t / steps:>9.1f} {n / steps:>10.1f}  {name[:110]}" for t, n, name in rows[:45]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--kernels", action="store_true", help="also write a per-kernel GPU time table")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or write_random_checkpoint(args.out / "ckpt-600M", "600M", dtype=torch.bfloat16)
    eng = Engine.load(model_dir, device="cuda", max_rows=1024)
    totals: dict[str, float] = defaultdict(float)
    report = {}
    rng = random.Random(0)
    instrumented = False
    for name, (batch, beams, src, new) in WORKLOADS.items():
        ids = [[eng.tokenizer.lang_id("eng_Latn")] + [rng.randrange(4, 250) for _ in range(src - 2)] + [2]
               for _ in range(batch)]
        opts = GenerationOptions(num_beams=beams, min_new_tokens=new, max_new_tokens=new)
        eng.generate(ids, "fra_Latn", opts)  # warm-up: graph capture for these buckets
        if not instrumented:
            instrument(eng, totals)
            instrumented = True
        totals.clear()
        start = time.perf_counter()
        eng.generate(ids, "fra_Latn", opts)
        wall = time.perf_counter() - start
        steps = new + 1
        report[name] = {"wall_ms": wall * 1e3, "per_step_ms": {k: totals[k] / steps * 1e3 for k in PHASES},
                        "steps": steps}
        print(name, f"wall {wall * 1e3:.1f} ms;", ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in totals.items()),
              "ms/step", flush=True)
        if args.kernels:
            (args.out / f"kernels_{name}.txt").write_text(kernel_table(eng, ids, opts, steps))
    (args.out / "profile.json").write_text(json.dumps(report, indent=1))
    eng.close()


if __name__ == "__main__":
    main()
