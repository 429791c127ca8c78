"""Where a whole run's time goes, without syncs: the engine alone on the greedy corpus (bench/corpus.py) and on
greedy B=256 and B=1024 (or the beam corpus, or one sentence 20 -> 20 greedy or beam 4: --workloads), each timed
(median of 3), then one run each with every step logged (when it started and ended, whether its batch was made on
the device, the rows in the table; the longest finishing pass part by part), one under the torch profiler (GPU
busy time and its kernels: bench/profile_steps.kernel_table) and one under cProfile (profile_steps.host_table,
OUT/host_<name>.txt; from Python 3.12 cProfile sees every thread, and a thread waiting for the GIL is charged to
the function it waits in).

    python3 -m bench.step_timeline --out OUT [--model-dir DIR] [--workloads corpus_beam4,...] [--quick]

A run whose GPU busy time is well below its wall is the host's; the step log says where: before the first step
(submission, the first admission), between steps, or after the last (finishing).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Callable

from bench.corpus import QUICK_SENTENCES, TGT, make_corpus
from bench.corpus import WORKLOADS as CORPUS_WORKLOADS
from bench.profile_steps import host_table, kernel_table
from bench.workloads import Vocab, fixed_inputs, fixed_spec
from engine import Engine, GenerationOptions
from engine import results
from engine.heap import settle_heap
from engine.jobs import Job
from engine.scheduler import Scheduler
from engine.step_loop import StepLoop
from engine.tokenizer import PendingTexts


# the parts of a finishing pass (StepLoop._finish) timed on their own: (owner, attribute) of each
FINISH_PARTS = {"release": (Scheduler, "release"), "candidates": (results, "candidates"),
                "translations": (results, "translation"), "texts waited": (PendingTexts, "at"),
                "jobs": (Job, "finish_segment")}


class StepLog:
    """Every StepLoop.step of the engine while on: (start, end, batch made on the device or None, rows used),
    every StepLoop._finish (start, end, segments finished, ms in each of FINISH_PARTS: the translations' include
    their texts' waits), and every pass of the cyclic collector, in any thread: (start, end, generation)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, bool | None, int]] = []
        self.finishes: list[tuple[float, float, int, dict[str, float]]] = []
        self.collections: list[tuple[float, float, int]] = []
        self.waits: list[tuple[float, float]] = []  # each _read_selection: the host waiting for the GPU, mostly
        # the finishing pass under way's ms in each part; None outside one (Scheduler.release also runs when a job
        # fails, Tokenizer.decode_batch's PendingTexts.at for any caller)
        self._parts: dict[str, float] | None = None
        for name, (owner, attribute) in FINISH_PARTS.items():
            setattr(owner, attribute, self._timed(name, getattr(owner, attribute)))
        self._collecting = 0.0
        self._on_device: bool | None = None
        gc.callbacks.append(self._on_collection)
        step, on_device, read, finish = (StepLoop.step, StepLoop._batch_on_device, StepLoop._read_selection,
                                         StepLoop._finish)

        def logged_batch(loop: StepLoop):
            batch = on_device(loop)
            self._on_device = batch is not None
            return batch

        def logged_step(loop: StepLoop) -> None:
            start, self._on_device = time.perf_counter(), None
            step(loop)
            self.steps.append((start, time.perf_counter(), self._on_device, loop.table.rows_used))

        def logged_read(loop: StepLoop, in_flight):
            start = time.perf_counter()
            outcome = read(loop, in_flight)
            self.waits.append((start, time.perf_counter()))
            return outcome

        def logged_finish(loop: StepLoop, segments: list) -> None:
            start, self._parts = time.perf_counter(), dict.fromkeys(FINISH_PARTS, 0.0)
            try:
                finish(loop, segments)
            finally:
                self.finishes.append((start, time.perf_counter(), len(segments), self._parts))
                self._parts = None
        StepLoop.step, StepLoop._batch_on_device, StepLoop._read_selection, StepLoop._finish = (
            logged_step, logged_batch, logged_read, logged_finish)

    def _timed(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self._parts is not None:
                    self._parts[name] += (time.perf_counter() - start) * 1e3
        return timed

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._collecting = time.perf_counter()
        else:
            self.collections.append((self._collecting, time.perf_counter(), info["generation"]))

    def summary(self, started: float, ended: float) -> str:
        """The steps of the run that went from `started` to `ended` (perf_counter) and ended inside it (the step
        that resolves the job ends after it), and the finishing passes that started inside it."""
        steps = [s for s in self.steps if s[2] is not None and started <= s[0] and s[1] <= ended]
        if not steps:
            return "no steps"
        on_device = sum(1 for s in steps if s[2])
        return (f"{len(steps)} steps, {on_device} made on the device; rows a step mean "
                f"{statistics.mean(s[3] for s in steps):.0f}; the first starts {(steps[0][0] - started) * 1e3:.1f} "
                f"ms in, the last ends {(steps[-1][1] - started) * 1e3:.1f} ms in, of {(ended - started) * 1e3:.1f}; "
                f"{self._finished(started, ended)}; {self._collected(started, ended)}; reading selections "
                f"{self._waited(started, ended):.1f} ms")

    def _finished(self, started: float, ended: float) -> str:
        passes = [f for f in self.finishes if started <= f[0] <= ended]
        if not passes:
            return "no segment finished"
        largest = max(passes, key=lambda f: f[1] - f[0])
        parts = ", ".join(f"{name} {ms:.1f}" for name, ms in largest[3].items())
        return (f"{sum(f[2] for f in passes)} segments finished in {len(passes)} passes, "
                f"{sum(f[1] - f[0] for f in passes) * 1e3:.1f} ms (the longest {(largest[1] - largest[0]) * 1e3:.1f} "
                f"ms, {largest[2]} segments: {parts} ms)")

    def _waited(self, started: float, ended: float) -> float:
        return sum(end - start for start, end in self.waits if started <= start <= ended) * 1e3

    def _collected(self, started: float, ended: float) -> str:
        passes = [c for c in self.collections if started <= c[0] <= ended]
        full = sum(1 for c in passes if c[2] == 2)
        return (f"{len(passes)} collector passes ({full} full), "
                f"{sum(c[1] - c[0] for c in passes) * 1e3:.1f} ms")


def workloads(eng: Engine, quick: bool) -> dict[str, Callable[[], object]]:
    """Each workload's run on bench.run's own inputs (workloads.fixed_inputs, bench/corpus.py)."""
    vocab = Vocab(eng.tokenizer)
    fixed = {name: fixed_inputs(fixed_spec(name, quick), vocab)
             for name in ("greedy_b256", "greedy_b1024", "latency_greedy", "latency_beam4")}
    return {"corpus_greedy": corpus_run(eng, vocab, "corpus_greedy", quick),
            "corpus_beam4": corpus_run(eng, vocab, "corpus_beam4", quick),
            **{name: partial(eng.generate, *inputs) for name, inputs in fixed.items()}}


def corpus_run(eng: Engine, vocab: Vocab, name: str, quick: bool) -> Callable[[], object]:
    """bench.run's corpus row `name` (bench/corpus.py): one job a sentence, each decoding its own length."""
    n, beams = CORPUS_WORKLOADS[name]
    corpus = make_corpus(vocab, QUICK_SENTENCES[name] if quick else n, quick)
    opts = {k: GenerationOptions(num_beams=beams, min_new_tokens=k, max_new_tokens=k)
            for k in {s.new_tokens for s in corpus}}

    def run() -> object:
        futures = [eng.submit_ids([s.source], TGT, opts[s.new_tokens]) for s in corpus]
        return [f.result() for f in futures]
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/ckpt-600M"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="the toy model's sizes (a smoke test)")
    parser.add_argument("--workloads", default="corpus_greedy,greedy_b256,greedy_b1024",
                        help="comma list of corpus_greedy, corpus_beam4, greedy_b256, greedy_b1024, latency_greedy, "
                             "latency_beam4")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    eng = Engine.load(None if args.quick else args.model_dir, device=args.device, max_rows=16 if args.quick else 1024)
    log = StepLog()
    try:
        eng.warm_up(eng.rows_total, 24 if args.quick else 200)
        settle_heap()  # the worker's collector settings (engine/heap.py)
        runs = workloads(eng, args.quick)
        for name in args.workloads.split(","):
            run = runs[name]
            for _ in range(3):
                run()
            walls = []
            for _ in range(3):
                started = time.perf_counter()
                run()
                walls.append(time.perf_counter() - started)
            eng._on_engine_thread(lambda: None)  # the step that resolved the run has ended and is logged
            print(f"{name}: wall median {statistics.median(walls) * 1e3:.1f} ms; last run: "
                  f"{log.summary(started, started + walls[-1])}", flush=True)
            steps = max(1, sum(1 for s in log.steps if s[2] is not None and s[0] >= started))
            if args.device == "cuda":
                table = kernel_table(run, steps)
                (args.out / f"kernels_{name}.txt").write_text(table)
                print(table.splitlines()[0], flush=True)
            (args.out / f"host_{name}.txt").write_text(host_table(eng, run, steps))
    finally:
        eng.close()


if __name__ == "__main__":
    main()
