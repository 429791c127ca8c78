"""Where a step's time goes: engine phases timed with a device sync around each (so GPU time is
attributed to the phase that queued it), then, with --kernels, one more run per workload under
torch.profiler: GPU time per kernel (graph replays included), written to OUT/kernels_<workload>.txt;
with --host, one more under cProfile on the engine's thread (the host's Python a step, without syncs),
written to OUT/host_<workload>.txt. Not a throughput benchmark: the syncs cost time too.

    python3 -m bench.profile_steps --out OUT [--model-dir DIR] [--workloads a,b] [--kernels] [--host]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

from bench import lora
from bench.workloads import SAMPLING
from engine import Engine, GenerationOptions
from bench.checkpoint import write_random_checkpoint

# the Selector's launch queues selection; _read_selection waits for it and applies it; without these syncs
# _apply_outcome overlaps the GPU's next step, and a step the device made (_batch_on_device) starts before the
# previous one's selection is read
PHASES = ["_prefill", "_decode_batch", "_batch_on_device", "_execute", "launch", "_read_selection", "_apply_outcome"]
# name -> (segments, beams, source tokens, new tokens, jobs): jobs None = one job of every segment;
# an int N = one job per segment, segment i on adapter i % N (0: no adapter); names with "sample" sample
# as bench/run.py's sampling rows do
WORKLOADS = {"latency_greedy": (1, 1, 20, 20, None), "latency_beam4": (1, 4, 20, 20, None),
             "greedy_b16": (16, 1, 32, 64, None), "greedy_b256": (256, 1, 32, 64, None),
             "greedy_b1024": (1024, 1, 32, 64, None),
             "sample_b256": (256, 1, 32, 64, None), "beam4_b256": (256, 4, 32, 64, None)}
WORKLOADS.update({name: (256, 1, 32, 64, n) for name, (n, qv) in lora.WORKLOADS.items() if not qv})  # all-module


def instrument(eng: Engine, totals: dict[str, float], on: dict[str, bool]) -> None:
    """Wrap each phase with a synchronising timer while on["timing"] (launch is the selector's, the rest
    are the engine's)."""
    def timed(name, fn):
        def wrapper(*args, **kwargs):
            if not on["timing"]:
                return fn(*args, **kwargs)
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            totals[name] += time.perf_counter() - start
            return out
        return wrapper
    for name in PHASES:
        owner = eng.selector if name == "launch" else eng.loop
        setattr(owner, name, timed(name, getattr(owner, name)))


def kernel_table(run: Callable[[], object], steps: int) -> str:
    """GPU time per kernel name over one run() (a whole workload), per decode step, largest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
    rows = [(e.self_device_time_total, e.count, e.key) for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]  # kernels and copies only
    rows.sort(reverse=True)
    total = sum(t for t, _, _ in rows)
    lines = [f"GPU busy {total / 1e3:.2f} ms over {steps} steps = {total / steps / 1e3:.3f} ms/step",
             idle_gaps([(e.time_range.start, e.time_range.end) for e in prof.events()
                        if e.device_type == DeviceType.CUDA]),
             f"{'us/step':>9} {'calls/step':>10}  name"]
    lines += [f"{t / steps:>9.1f} {n / steps:>10.1f}  {name[:110]}" for t, n, name in rows[:45]]
    return "\n".join(lines)


def idle_gaps(spans: list[tuple[float, float]], short_us: float = 10.0, listed: int = 8) -> str:
    """Where the GPU sat idle between its first kernel and its last, from the kernels' (start, end) in us: gaps
    under `short_us` are a graph's own launch gaps, longer ones the GPU waiting for the host. The `listed`
    longest gaps are given with where they start (ms into the span), which tells a per-step wait (one a step,
    evenly spread) from a one-off (an admission, a prefill's inputs)."""
    spans.sort()
    short, longer = 0.0, []
    end = spans[0][1] if spans else 0.0
    for start, stop in spans[1:]:
        gap = start - end
        if gap >= short_us:
            longer.append((gap, end - spans[0][0]))
        elif gap > 0:
            short += gap
        end = max(end, stop)
    span = end - spans[0][0] if spans else 0.0
    longest = ", ".join(f"{gap:.0f} us at {at / 1e3:.1f} ms" for gap, at in sorted(longer, reverse=True)[:listed])
    return (f"GPU span {span / 1e3:.2f} ms: idle {short / 1e3:.2f} ms in gaps under {short_us:.0f} us, "
            f"{sum(g for g, _ in longer) / 1e3:.2f} ms in longer ones ({len(longer)}; longest {longest or 'none'})")


def host_table(eng: Engine, run: Callable[[], object], steps: int) -> str:
    """The engine thread's Python over one run() (cProfile, no syncs): top functions by own time."""
    prof = cProfile.Profile()
    eng._on_engine_thread(prof.enable)  # cProfile follows the thread that enables it
    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
    eng._on_engine_thread(prof.disable)
    return f"wall {wall * 1e3:.1f} ms over {steps} steps (under cProfile)\n{profile_text(prof)}"


def profile_text(prof: cProfile.Profile, by_own: int = 30, by_cumulative: int = 40) -> str:
    """The profile's top `by_own` functions by their own time, then its top `by_cumulative` by cumulative time."""
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(by_own)
    stats.sort_stats("cumulative").print_stats(by_cumulative)
    return text.getvalue()


def workload_run(eng: Engine, name: str, rng: random.Random) -> Callable[[], object]:
    """A callable that runs the workload once (the same inputs every call)."""
    batch, beams, src, new, jobs = WORKLOADS[name]
    ids = [[eng.tokenizer.lang_id("eng_Latn")] + [rng.randrange(4, 250) for _ in range(src - 2)] + [2]
           for _ in range(batch)]
    sampling = dict(do_sample=True, seed=0, **SAMPLING) if "sample" in name else {}
    opts = GenerationOptions(num_beams=beams, min_new_tokens=new, max_new_tokens=new, **sampling)
    if jobs is None:
        return lambda: eng.generate(ids, "fra_Latn", opts)
    names = lora.adapter_names(jobs) if jobs else [None]
    return lambda: lora.generate_mixed(eng, ids, "fra_Latn", opts, names)


def warm_up(eng: Engine, spec: tuple, run: Callable[[], object]) -> None:
    """Every graph the workload can pass through, then one run (adapters made resident, allocator)."""
    batch, beams, src, _, jobs = spec
    run()  # first: an adapted run installs the adapters whose sites the LoRA graphs cover
    eng.warm_up(batch * beams, src, adapted=bool(jobs), beams=beams)
    run()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {list(WORKLOADS)}")
    parser.add_argument("--kernels", action="store_true", help="also write a per-kernel GPU time table")
    parser.add_argument("--host", action="store_true", help="also write the engine thread's cProfile table")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or write_random_checkpoint(args.out / "ckpt-600M", "600M", dtype=torch.bfloat16)
    names = args.workloads.split(",")
    adapters = max((WORKLOADS[n][4] or 0 for n in names), default=0)
    options = lora.engine_options([f"greedy_b256_lora{adapters}"], model_dir) if adapters else {}
    eng = Engine.load(model_dir, device="cuda", max_rows=1024, **options)
    totals: dict[str, float] = defaultdict(float)
    report = {}
    rng = random.Random(0)
    on = {"timing": False}
    instrument(eng, totals, on)
    for name in names:
        spec = WORKLOADS[name]
        run = workload_run(eng, name, rng)
        warm_up(eng, spec, run)
        start = time.perf_counter()
        run()
        free = time.perf_counter() - start  # without the syncs
        totals.clear()
        on["timing"] = True
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
        on["timing"] = False
        steps = spec[3] + 1
        report[name] = {"wall_ms": wall * 1e3, "wall_without_syncs_ms": free * 1e3, "steps": steps,
                        "per_step_ms": {k: totals[k] / steps * 1e3 for k in PHASES}}
        print(name, f"wall {wall * 1e3:.1f} ms ({free * 1e3:.1f} without the syncs);",
              ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in totals.items()), "ms/step", flush=True)
        if args.kernels:
            (args.out / f"kernels_{name}.txt").write_text(kernel_table(run, steps))
        if args.host:
            (args.out / f"host_{name}.txt").write_text(host_table(eng, run, steps))
    (args.out / "profile.json").write_text(json.dumps(report, indent=1))
    eng.close()
    if options:
        shutil.rmtree(options["adapters_dir"], ignore_errors=True)


if __name__ == "__main__":
    main()
