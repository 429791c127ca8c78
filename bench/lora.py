"""LoRA rows of the benchmark: greedy B=256 with 1, 8 or 32 distinct rank-16 adapters mixed.

A row `greedy_b256_loraN` is greedy_b256 (source 32 tokens, exactly 64 new tokens) sent as one job
per segment, job i on adapter i % N, so rows of N adapters share every batched step. Its ratio to
the same 256 jobs without an adapter is the cost of the adapters (0.8x or more is the aim): against
greedy_b256, one job of 256 segments, the LoRA rows would also pay for 256 separate submissions
joining the running batch over a few steps. The ratio comes from runs with and without the adapters
taken in turns (bench.run.alternated_times): a base row timed minutes earlier moved by ~4% from one
machine state to the next. greedy_b256_jobs, the base as a row of its own, runs first. HF `generate`
has no multi-adapter batch, so these rows have no HF counterpart.

The adapters are random PEFT folders (adapter_config.json + adapter_model.safetensors, PEFT's key
names), written here without peft, for every q/k/v/out projection (self and cross attention) and
fc1/fc2 of every encoder and decoder layer of the checkpoint.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save_file

from engine import Engine, GenerationOptions, Translation
from engine.config import ModelConfig, load_config

SHAPE_WORKLOAD = "greedy_b256"  # every row here copies this workload's spec
BASE_WORKLOAD = "greedy_b256_jobs"  # the no-adapter row the others are compared with
RANK = 16
ALPHA = 16
MAX_ADAPTERS = 32
TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
QV_TARGETS = ["q_proj", "v_proj"]  # PEFT's default for BART-type models (it has none for m2m_100)
# row -> (adapters, q/v only); 0 adapters: the base row. The q/v row comes before the others: the
# engine's LoRA graphs cover every site any installed adapter adapts, so once an all-module adapter
# is in, q/v rows would pay for every site too.
WORKLOADS = {BASE_WORKLOAD: (0, False), "greedy_b256_lora32qv": (32, True), "greedy_b256_lora1": (1, False),
             "greedy_b256_lora8": (8, False), "greedy_b256_lora32": (32, False)}
B_STD = 0.01  # A ~ N(0, 1/in), so each adapter adds ~B_STD * sqrt(RANK) per output: visible, not dominant


def adapter_names(n: int, qv: bool = False) -> list[str]:
    """The folder names of the first n bench adapters (row loraN uses the first N)."""
    return [f"bench-{'qv-' if qv else ''}r{RANK}-{i:02d}" for i in range(n)]


def row_names(workload: str) -> list[str | None]:
    """The adapters a row mixes ([None]: the base model)."""
    return adapter_names(*WORKLOADS[workload]) or [None]


def with_base(names: Sequence[str]) -> list[str]:
    """The workload list with greedy_b256 run before the first LoRA row (added, or moved up)."""
    lora_at = next((i for i, n in enumerate(names) if n in WORKLOADS), None)
    if lora_at is None or BASE_WORKLOAD in names[:lora_at]:
        return list(names)
    names = [n for n in names if n != BASE_WORKLOAD]  # only entries after lora_at go: the index holds
    names.insert(lora_at, BASE_WORKLOAD)
    return names


def _modules(cfg: ModelConfig, targets: Sequence[str]) -> list[tuple[str, int, int]]:
    """Every adapted module as (PEFT module path, in_features, out_features)."""
    d = cfg.d_model
    mods = []
    for stack, layers, ffn in (("encoder", cfg.encoder_layers, cfg.encoder_ffn_dim),
                               ("decoder", cfg.decoder_layers, cfg.decoder_ffn_dim)):
        attns = ("self_attn", "encoder_attn") if stack == "decoder" else ("self_attn",)
        for i in range(layers):
            prefix = f"base_model.model.model.{stack}.layers.{i}"
            mods += [(f"{prefix}.{attn}.{p}", d, d) for attn in attns for p in TARGETS[:4] if p in targets]
            mods += [m for m in ((f"{prefix}.fc1", d, ffn), (f"{prefix}.fc2", ffn, d)) if m[0][-3:] in targets]
    return mods


def adapter_tensors(cfg: ModelConfig, seed: int, targets: Sequence[str] = TARGETS) -> dict[str, torch.Tensor]:
    """Random lora_A [r, in] and lora_B [out, r] (both non-zero) for every module, in bf16."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for module, d_in, d_out in _modules(cfg, targets):
        a = torch.empty(RANK, d_in).normal_(0.0, d_in ** -0.5, generator=gen)
        b = torch.empty(d_out, RANK).normal_(0.0, B_STD, generator=gen)
        out[f"{module}.lora_A.weight"] = a.to(torch.bfloat16)
        out[f"{module}.lora_B.weight"] = b.to(torch.bfloat16)
    return out


def adapter_config(model_dir: Path, targets: Sequence[str] = TARGETS) -> dict:
    """adapter_config.json as PEFT's LoraConfig saves it (the fields the engine vets included)."""
    return {"peft_type": "LORA", "task_type": "SEQ_2_SEQ_LM", "base_model_name_or_path": str(model_dir),
            "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0, "target_modules": list(targets), "bias": "none",
            "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
            "init_lora_weights": False, "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {},
            "layers_to_transform": None, "layers_pattern": None, "revision": None}


def write_adapters(model_dir: Path, out_dir: Path, n: int, qv: bool = False) -> list[Path]:
    """Write adapters 0..n-1 for the checkpoint in model_dir into out_dir/<name>; seed i for adapter i."""
    cfg = load_config(Path(model_dir))
    targets = QV_TARGETS if qv else TARGETS
    config = json.dumps(adapter_config(Path(model_dir), targets), indent=2) + "\n"
    folders = []
    for seed, name in enumerate(adapter_names(n, qv)):
        folder = Path(out_dir) / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_config.json").write_text(config)
        save_file(adapter_tensors(cfg, seed, targets), folder / "adapter_model.safetensors")
        folders.append(folder)
    return folders


def engine_options(names: Sequence[str], model_dir: Path) -> dict:
    """Engine.load keyword arguments for this run: {} without LoRA rows; else the bench's residency
    limits and a new temporary adapters_dir (outside --out: 0.5 GB at 600M, 2 GB at 3.3B; the caller
    removes it) holding as many adapters as the largest row needs."""
    needed = {qv: max((WORKLOADS[n][0] for n in names if WORKLOADS.get(n, (0, not qv))[1] == qv), default=0)
              for qv in (False, True)}
    if not any(needed.values()):
        return {}
    adapters_dir = Path(tempfile.mkdtemp(prefix="nllb-bench-adapters-"))
    for qv, n in needed.items():
        write_adapters(model_dir, adapters_dir, n, qv)
    return {"adapters_dir": adapters_dir, "max_adapters": MAX_ADAPTERS, "max_lora_rank": RANK}


def make_resident(eng: Engine, names: Sequence[str], src_ids: list[int], tgt: str) -> None:
    """One one-token job per adapter, waited for: every adapter is read and installed before timing."""
    opts = GenerationOptions(max_new_tokens=1)
    for future in [eng.submit_ids([src_ids], tgt, opts, adapter=name) for name in names if name]:
        future.result()


def generate_mixed(eng: Engine, batch: Sequence[Sequence[int]], tgt: str, options: GenerationOptions,
                   names: Sequence[str]) -> list[Translation]:
    """Engine.generate's contract (one Translation per segment, in order), but segment i is its own
    job on adapter names[i % len(names)]; all are submitted before any is waited for."""
    futures = [eng.submit_ids([src], tgt, options, adapter=names[i % len(names)]) for i, src in enumerate(batch)]
    return [future.result()[0] for future in futures]


def note(workload: str, times: tuple[float, float] | None) -> str:
    """The row's note: the adapter mix, its ratio to the same jobs without adapters (median seconds of each,
    runs in turns), and why HF is absent."""
    n, qv = WORKLOADS[workload]
    if not n:
        return "no adapter, one job per segment as in the LoRA rows (their base); HF not run"
    base_s, lora_s = times
    vs = (f"{base_s / lora_s:.2f}x no-adapter (the same jobs without adapters, in turns: {base_s:.3f} s / "
          f"{lora_s:.3f} s)")
    targets = "q_proj/v_proj" if qv else "all q/k/v/out/fc1/fc2"
    return (f"{vs}; {n} rank-{RANK} adapter{'s' if n > 1 else ''} ({targets}), job i on adapter i % {n}; "
            "floor without the LoRA work; HF not run (no multi-adapter batch)")
