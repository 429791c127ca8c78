"""Settings of one module attribute timed in turns in one engine: the A/B of a change that a flag switches
(`engine.step_loop.SPLIT_ROWS`, `kernels.linear_triton.ENABLED`, ...), on the bench's fixed and corpus rows.

    python3 -m bench.ab --model-dir /tmp/ckpt-600M --set engine.step_loop.SPLIT_ROWS=None,128 \\
        --workloads greedy_b256,beam4_b64,corpus_greedy

Each setting keeps its own CUDA graphs, captured under it and swapped in with it, so that the runs in turns replay
what each setting captured. For each workload: the warm-up under every setting, then `--pairs` runs of each in
turns (workloads.alternated_times, so a machine that drifts moves every setting alike). The report gives each
setting's tokens/s, its ratio to the first setting's, and how many segments' tokens equal the first setting's: a
change that keeps the bits must give all of them.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from bench import corpus
from bench.workloads import Vocab, fixed_inputs, fixed_spec, timed_run, warm_up_fixed


@dataclass
class Setting:
    """One value of the attribute under test, and the graphs the engine captured under it."""

    owner: object  # the module holding the attribute
    name: str
    value: object
    decode_graphs: dict = field(default_factory=dict)  # DecodeGraphs.graphs under this value
    prefill_graphs: dict = field(default_factory=dict)  # EncoderGraphs.graphs under this value

    @property
    def label(self) -> str:
        return f"{self.name}={self.value!r}"

    def apply(self, eng) -> None:
        setattr(self.owner, self.name, self.value)
        if eng.graphs is not None:
            eng.graphs.graphs, eng.prefill.graphs.graphs = self.decode_graphs, self.prefill_graphs


def parse_settings(text: str) -> list[Setting]:
    """`module.attribute=v1,v2,...` (Python literals) -> a Setting per value, the first the baseline."""
    target, _, values = text.partition("=")
    module, _, name = target.rpartition(".")
    if not module or not values:
        raise ValueError(f"--set {text!r}: expected module.attribute=value,value")
    owner = importlib.import_module(module)
    if not hasattr(owner, name):
        raise ValueError(f"--set {text!r}: {module} has no attribute {name}")
    parsed = [ast.literal_eval(v.strip()) for v in values.split(",")]
    if len(parsed) < 2:
        raise ValueError(f"--set {text!r}: give two values or more, the first the baseline")
    return [Setting(owner, name, v) for v in parsed]


@dataclass
class Workload:
    run: Callable[[], list]  # one run: a Translation per segment
    warm_up: Callable[[], None]  # graphs and allocator ready for `run`
    tokens: int  # tokens a run counts (bench.run's count)


def workload(name: str, eng, vocab: Vocab, quick: bool) -> Workload:
    """A corpus row (bench/corpus.py) or a fixed row (bench/workloads.py's fixed_spec) as bench.run runs ours."""
    if name in corpus.WORKLOADS:
        n, beams = corpus.WORKLOADS[name]
        sentences = corpus.make_corpus(vocab, corpus.QUICK_SENTENCES[name] if quick else n, quick)
        run = corpus.corpus_jobs(eng, sentences, beams)
        return Workload(run, lambda: corpus.warm_up_corpus(eng, run, sentences, beams),
                        sum(s.new_tokens for s in sentences))
    spec = fixed_spec(name, quick)
    batch, tgt, opts = fixed_inputs(spec, vocab)

    def run() -> list:
        return eng.generate(batch, tgt, opts)
    return Workload(run, lambda: warm_up_fixed(eng, spec, batch, run), spec.batch * spec.new_tokens)


def compare(name: str, work: Workload, settings: list[Setting], eng, device: str, pairs: int) -> list[dict]:
    """Every setting warmed up, then `pairs` rounds of a run of each in turns: a row per setting."""
    tokens: dict[str, list] = {}
    for s in settings:
        s.apply(eng)
        work.warm_up()
        tokens[s.label] = [t.tokens for t in work.run()]
    times: dict[str, list[float]] = {s.label: [] for s in settings}
    for _ in range(pairs):
        for s in settings:
            s.apply(eng)
            times[s.label].append(timed_run(work.run, device)[0])
    base = settings[0].label
    rows = []
    for s in settings:
        seconds = statistics.median(times[s.label])
        same = sum(a == b for a, b in zip(tokens[base], tokens[s.label]))
        rows.append({"workload": name, "setting": s.label, "seconds": seconds, "tokens_per_s": work.tokens / seconds,
                     "vs_first": statistics.median(times[base]) / seconds, "same_segments": same,
                     "segments": len(tokens[base])})
    return rows


def markdown(rows: list[dict], command: str, device_name: str) -> str:
    lines = [f"`{command}` on {device_name}", "",
             "| workload | setting | tokens/s | vs first | segments with the first's tokens |", "|---|---|---|---|---|"]
    lines += [f"| {r['workload']} | `{r['setting']}` | {r['tokens_per_s']:,.0f} | {r['vs_first']:.3f} | "
              f"{r['same_segments']}/{r['segments']} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, help="a checkpoint (default: the toy model)")
    p.add_argument("--set", required=True, dest="settings", help="module.attribute=baseline,value[,value...]")
    p.add_argument("--workloads", required=True, help="comma list of fixed rows (greedy_b256, ...) and corpus rows")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--pairs", type=int, default=7, help="runs of each setting, in turns")
    p.add_argument("--max-rows", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="bench.run's quick batches")
    p.add_argument("--out", type=Path, help="a folder for ab.json and ab.md")
    args = p.parse_args(argv)
    try:
        settings = parse_settings(args.settings)
    except (ValueError, SyntaxError, ImportError) as exc:
        p.error(str(exc))
    from engine import Engine
    eng = Engine.load(args.model_dir, device=args.device, max_rows=args.max_rows)
    rows: list[dict] = []
    try:
        vocab = Vocab(eng.tokenizer)
        for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
            rows += compare(name, workload(name, eng, vocab, args.quick), settings, eng, args.device, args.pairs)
            for r in rows[-len(settings):]:
                print(f"{r['workload']} {r['setting']}: {r['tokens_per_s']:,.0f} tok/s ({r['vs_first']:.3f}x), "
                      f"{r['same_segments']}/{r['segments']} segments with the first's tokens", flush=True)
    finally:
        settings[0].apply(eng)
        eng.close()
    command = " ".join(["python3 -m bench.ab"] + (argv if argv is not None else sys.argv[1:]))
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ab.json").write_text(json.dumps({"command": command, "device": device_name, "rows": rows},
                                                     indent=1))
        (args.out / "ab.md").write_text(markdown(rows, command, device_name))
    print(markdown(rows, command, device_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
