"""Per-job LoRA: PEFT adapters resident in preallocated stacks, applied to mixed batches.

Adapters live in a directory, one folder per name (`adapter_config.json` +
`adapter_model.safetensors`, as PEFT saves them). Up to `max_adapters` are resident at once in
stacks allocated at start; slot 0 means "no adapter". A row or token carries its slot index, so
rows of different adapters and rows of none go through one batched step. Files are read on a
background thread (the step loop never waits on disk); the least recently used adapter that no
running segment holds leaves first.

Stacks per projection site: A [S, P, R, in], Bt [S, P, R, out] (B transposed: rows of outputs)
and ranks [S] int32, where S = max_adapters + 1 rounded up so that S x R is a multiple of 64
(aligned_slots: the slots past the adapters' stay zero), P the parts of a fused projection (q|k|v:
3, cross k|v: 2, else 1) and R the rank limit rounded up to a multiple of 16 (the tensor-core
kernel's tile). An adapter's scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into Bt; a
smaller rank is zero-padded and its rank recorded per site (0 where the adapter leaves the site
alone): the kernel drops what lies past it.

Three ways to apply them. The prefill (encoder, cross k|v) adds the delta after the projection's GEMM
with tiles of rows of one slot (kernels lora_apply). The decoder step, where a LoRA kernel after each
of 72 GEMMs would cost as much as the GEMMs themselves (docs/performance.md, LoRA), has none:
- q|k|v, out, cross out and fc2 stack every slot's A rows under the projection's weight (W_ext
  [P*O + S*P*R, I], A of slot s, part p, rank r at row P*O + (s*P + p)*R + r), so the one GEMM also gives
  each row its h for every slot, and the op that reads the projection adds the row's own delta
  (kv_append_lora, add_layer_norm).
- cross q and fc1, whose input is a LayerNorm's output (`shrunk_in_norm`), the other way round: the
  LayerNorm kernel appends each row's h for its own slot (zeros for every other slot) to the normed row,
  and the projection's weight has every slot's B after its columns (W_ext [O, I + S*R], B of slot s,
  rank r at column I + s*R + r), so the one GEMM adds the delta before its bias and ReLU. These two have
  no op of ours after the GEMM that could add it (the attention's q would need its own expand: 4 us a
  launch; fc1 an expand launch: 5 us). q|k|v stays as above: its three parts' B would sit block-diagonal
  under one GEMM, three times the bytes.
A step whose rows' slots all lie below AdapterRegistry.slot_bound's first quarter runs these GEMMs over
that quarter's rows or columns only (the stacks are slot-major, so they are a prefix).
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.config import ModelConfig
from engine.errors import UnknownAdapter
from engine.model import LoraBatch
from engine.weights import Linear, Weights
from kernels.limits import LORA_MAX_RANK, LORA_MAX_SLOTS

log = logging.getLogger("engine")

# PEFT module -> (site, part): the engine fuses q|k|v and cross k|v into one projection each.
_SITES = {
    ("self_attn", "q_proj"): ("qkv", 0), ("self_attn", "k_proj"): ("qkv", 1), ("self_attn", "v_proj"): ("qkv", 2),
    ("self_attn", "out_proj"): ("out", 0),
    ("encoder_attn", "q_proj"): ("cross_q", 0), ("encoder_attn", "k_proj"): ("cross_kv", 0),
    ("encoder_attn", "v_proj"): ("cross_kv", 1), ("encoder_attn", "out_proj"): ("cross_out", 0),
    ("", "fc1"): ("fc1", 0), ("", "fc2"): ("fc2", 0),
}
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
RANK_LIMIT = LORA_MAX_RANK  # the largest max_rank a registry takes: the rank the LoRA kernels hold
_KEY = re.compile(r"(?:^|\.)(encoder|decoder)\.layers\.(\d+)\.(?:(self_attn|encoder_attn)\.)?"
                  r"(q_proj|k_proj|v_proj|out_proj|fc1|fc2)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # used with fullmatch: "$" also matches before a final "\n"

Site = tuple[str, int, str]  # (stack "encoder"/"decoder", layer, site name)


def in_decoder_step(site: Site) -> bool:
    """Whether the decoder step adapts this site (every decoder projection but cross k|v, which the prefill makes):
    its A rows (or, where `shrunk_in_norm`, its B columns) ride in the projection's GEMM."""
    return site[0] == "decoder" and site[2] != "cross_kv"


def shrunk_in_norm(site: Site) -> bool:
    """Whether the LayerNorm before this decoder step site makes each row's h (cross q, fc1; module docstring)."""
    return site[0] == "decoder" and site[2] in ("cross_q", "fc1")


def site_shapes(cfg: ModelConfig) -> dict[Site, tuple[int, int, int]]:
    """Every adaptable projection: site -> (parts, in_features, out_features per part)."""
    d = cfg.d_model
    shapes: dict[Site, tuple[int, int, int]] = {}
    for stack, layers, ffn in (("encoder", cfg.encoder_layers, cfg.encoder_ffn_dim),
                               ("decoder", cfg.decoder_layers, cfg.decoder_ffn_dim)):
        for i in range(layers):
            shapes.update({(stack, i, "qkv"): (3, d, d), (stack, i, "out"): (1, d, d),
                           (stack, i, "fc1"): (1, d, ffn), (stack, i, "fc2"): (1, ffn, d)})
            if stack == "decoder":
                shapes.update({(stack, i, "cross_q"): (1, d, d), (stack, i, "cross_kv"): (2, d, d),
                               (stack, i, "cross_out"): (1, d, d)})
    return shapes


@dataclass
class AdapterWeights:
    """One adapter read from disk: site -> part -> (A [r, in], B scaled [out, r]), on the CPU."""

    name: str
    parts: dict[Site, dict[int, tuple[torch.Tensor, torch.Tensor]]]


def read_adapter_config(folder: Path, max_rank: int) -> dict:
    """Parse and vet adapter_config.json; UnknownAdapter says what is refused and why."""
    name = folder.name
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise UnknownAdapter(f"adapter {name!r} has no adapter_config.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UnknownAdapter(f"adapter {name!r}: adapter_config.json is not valid JSON ({exc})") from None
    refusals = []
    if config.get("peft_type", "LORA") != "LORA":
        refusals.append(f"peft_type {config.get('peft_type')!r} (only LORA is served)")
    if config.get("use_dora"):
        refusals.append("DoRA (use_dora=true); merge it into a plain LoRA or serve it elsewhere")
    if config.get("bias", "none") != "none":
        refusals.append(f"bias={config['bias']!r} (only 'none')")
    if config.get("modules_to_save"):
        refusals.append(f"modules_to_save={config['modules_to_save']} (only LoRA matrices are served)")
    if config.get("alpha_pattern"):
        refusals.append("alpha_pattern (one lora_alpha per adapter)")
    if config.get("fan_in_fan_out"):
        refusals.append("fan_in_fan_out=true")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(t.split(".")[-1] for t in targets) - set(SUPPORTED_MODULES))
        if unknown:
            refusals.append(f"target_modules {unknown} (supported: {', '.join(SUPPORTED_MODULES)})")
    ranks = [int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())]
    if max(ranks) > max_rank:
        refusals.append(f"rank {max(ranks)} over this worker's limit of {max_rank}")
    if refusals:
        raise UnknownAdapter(f"adapter {name!r} is refused: " + "; ".join(refusals))
    return config


def load_adapter(folder: Path, cfg: ModelConfig, max_rank: int) -> AdapterWeights:
    """Read an adapter's tensors and check every one against the base model's shapes."""
    config = read_adapter_config(folder, max_rank)
    name, shapes = folder.name, site_shapes(cfg)
    try:
        tensors = load_file(folder / "adapter_model.safetensors")
    except (FileNotFoundError, SafetensorError, OSError) as exc:
        raise UnknownAdapter(f"adapter {name!r}: adapter_model.safetensors unreadable ({exc})") from None
    pairs: dict[tuple[Site, int], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if not match:
            raise UnknownAdapter(f"adapter {name!r}: tensor {key!r} adapts a module this engine does not "
                                 f"(supported: {', '.join(SUPPORTED_MODULES)} in encoder and decoder layers)")
        stack, layer, attn, module, which = match.groups()
        site_name, part = _SITES[(attn or "", module)]
        site = (stack, int(layer), site_name)
        if site not in shapes:
            raise UnknownAdapter(f"adapter {name!r}: {key!r} names a layer the base model does not have")
        pairs.setdefault((site, part), {})[which] = tensor.float()
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    parts: dict[Site, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (site, part), ab in pairs.items():
        _, d_in, d_out = shapes[site]
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise UnknownAdapter(f"adapter {name!r}: {site} has lora_{'B' if a is not None else 'A'} "
                                 "without its pair")
        rank = a.shape[0]
        if a.shape != (rank, d_in) or b.shape != (d_out, rank) or rank > max_rank:
            raise UnknownAdapter(f"adapter {name!r}: {site} has A {tuple(a.shape)}, B {tuple(b.shape)}; the base "
                                 f"model needs A [r, {d_in}], B [{d_out}, r] with r <= {max_rank}")
        scaling = alpha / (rank ** 0.5 if rslora else rank)
        parts.setdefault(site, {})[part] = (a, b * scaling)
    if not parts:
        raise UnknownAdapter(f"adapter {name!r} holds no LoRA tensors")
    return AdapterWeights(name, parts)


class AdapterRegistry:
    """Residency of adapters in device stacks (LRU, refcounted). Engine-thread methods are
    `acquire`/`release`/`install_ready`; `check` is called from submitting threads."""

    def __init__(self, adapters_dir: Path, cfg: ModelConfig, weights: Weights, max_adapters: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        """The decoder step's projections in `weights` are moved into their stacked weights (W_ext): each
        Linear's weight and bias become views of the stacked ones' first rows."""
        if not 1 <= max_rank <= RANK_LIMIT:
            raise ValueError(f"max_lora_rank={max_rank}: adapters of rank 1 to {RANK_LIMIT} are served")
        self.dir, self.cfg, self.max_rank = adapters_dir, cfg, max_rank
        self.shapes = site_shapes(cfg)
        stack_rank = -(-max_rank // 16) * 16  # whole 16-rank tiles for the tensor-core kernel (zero past a rank)
        # S: slot 0 is "no adapter", then the adapters', then slots never taken (aligned_slots)
        self.slots = slots = aligned_slots(max_adapters + 1, stack_rank)
        if slots > LORA_MAX_SLOTS:
            raise ValueError(f"max_adapters={max_adapters}: at most {LORA_MAX_SLOTS - 1} adapters can be resident "
                             "at once (the LoRA kernels' slot limit, kernels/limits.py)")
        self._tight = aligned_slots(1 + max(1, max_adapters // 4), stack_rank)  # slot_bound's cut
        self.A: dict[Site, torch.Tensor] = {}  # the prefill's sites and shrunk_in_norm's: [S, P, R, I]
        self.W_ext: dict[Site, torch.Tensor] = {}  # the decoder step's: [P*O + P*S*R, I], the weight, then A;
        # shrunk_in_norm's [O, I + S*R], the weight, then each slot's B (its Bt is a view of these columns)
        self.b_ext: dict[Site, torch.Tensor | None] = {}  # [P*O + P*S*R]: the bias, then zeros (None: no bias);
        # shrunk_in_norm's the layer's own bias
        self.Bt: dict[Site, torch.Tensor] = {}
        self.ranks: dict[Site, torch.Tensor] = {}
        def stack(parts: int, width: int) -> torch.Tensor:  # [S, P, R, width] zeros
            return torch.zeros(slots, parts, stack_rank, width, dtype=dtype, device=device)

        for site, (parts, d_in, d_out) in self.shapes.items():
            if shrunk_in_norm(site):  # B in the weight's columns; A read by the LayerNorm before it
                layer = getattr(weights.decoder[site[1]], site[2])
                self.W_ext[site], self.Bt[site] = _stack_columns(layer, slots, stack_rank)
                self.A[site], self.b_ext[site] = stack(parts, d_in), layer.bias
            elif in_decoder_step(site):  # A in the weight's rows
                layer = getattr(weights.decoder[site[1]], site[2])
                self.W_ext[site], self.b_ext[site] = _stack(layer, parts * slots * stack_rank)
                self.Bt[site] = stack(parts, d_out)
            else:  # the prefill's (lora_apply)
                self.A[site], self.Bt[site] = stack(parts, d_in), stack(parts, d_out)
            self.ranks[site] = torch.zeros(slots, dtype=torch.int32, device=device)
        self.slot_of: dict[str, int] = {}  # resident adapter -> slot (1..max_adapters)
        self.sites_of: dict[int, set[Site]] = {}  # slot -> the sites its adapter adapts
        # every site any adapter installed so far adapts; only grows, so decode graphs captured with it
        # (engine/graphs.py) are few: a new graph only when an adapter brings a new site
        self.installed_sites: frozenset[Site] = frozenset()
        self._cuts: dict[int, tuple] = {}  # slot bound -> batch()'s stacks cut to it (views, made once)
        self.refs: dict[int, int] = {}  # slot -> running segments using it
        self.lru: list[str] = []  # resident names, least recently used first
        self.free_slots = list(range(1, max_adapters + 1))
        self.failed: dict[str, UnknownAdapter] = {}  # names whose files were refused at load
        self._vetted: dict[str, int] = {}  # name -> mtime_ns of the adapter_config.json that passed check
        self._loading: dict[str, Future] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="adapter-reader")
        self._lock = threading.Lock()

    def check(self, name: str) -> None:
        """Fail fast at submission: the folder must exist and its config must be servable."""
        if not _NAME.fullmatch(name):
            raise UnknownAdapter(f"adapter name {name!r} is not a folder name (letters, digits, '.', '_', '-')")
        with self._lock:
            if name in self.failed and name not in self.slot_of:
                self.failed.pop(name)  # the folder may have been fixed: try again
        try:  # a config vetted and unchanged since is not parsed again: one os.stat a job (3.7 us; pathlib 11.6)
            mtime = os.stat(os.path.join(self.dir, name, "adapter_config.json")).st_mtime_ns
        except OSError:
            mtime = None  # no folder, or a missing config: said below
        if mtime is not None and self._vetted.get(name) == mtime:
            return
        folder = self.dir / name
        if not folder.is_dir():
            # no path and no other names: a reply goes to one tenant, the folder holds every tenant's
            raise UnknownAdapter(f"adapter {name!r} is not served by this worker")
        read_adapter_config(folder, self.max_rank)
        self._vetted[name] = mtime

    def batch(self, idx: torch.Tensor, sites: set, ops: ModuleType, *, tiled: bool,
              slots: int | None = None) -> LoraBatch:
        """The adapters of tokens or rows whose adapter slots are idx [N] (0: none), applied at `sites`; `tiled`
        (the prefill's lora_apply): with the tiles, built here on the device once for every site of the pass.
        A decode step expands each row's delta from its own h and needs none. `slots` (a decode step's
        slot_bound; None: all): every row's slot is below it, and the step's stacks cover only those slots."""
        tiles = ops.lora_tiles(idx, self.slots) if tiled else None
        if slots is None or slots >= self.slots:
            return LoraBatch(self.A, self.W_ext, self.b_ext, self.Bt, self.ranks, idx, tiles, sites)
        if slots not in self._cuts:
            self._cuts[slots] = self._step_stacks(slots)
        return LoraBatch(*self._cuts[slots], idx, tiles, sites)

    def slot_bound(self, slots: set[int]) -> int:
        """The slot bound of a decode step whose rows hold these slots: the first quarter of the adapters' slots
        (with slot 0, aligned) when every one is in it, else all of them. A step's GEMMs over the stacked weights
        widen with the slots they cover (at 36 slots of rank 16 and 256 rows, q|k|v's GEMM +1.1 us, fc1's +1.3),
        and slots are taken lowest first, so a few adapters resident cost about a quarter
        of that. Two bounds: two sets of decode graphs."""
        return self._tight if max(slots, default=0) < self._tight else self.slots

    def _step_stacks(self, k: int) -> tuple[dict, dict, dict, dict, dict]:
        """(A, W_ext, b_ext, Bt, ranks) with the decoder step's sites cut to their first k slots (views: the
        stacked weights' first rows or columns); the prefill's sites whole."""
        A, W_ext, b_ext, Bt, ranks = (dict(d) for d in (self.A, self.W_ext, self.b_ext, self.Bt, self.ranks))
        for site, (parts, d_in, d_out) in self.shapes.items():
            if not in_decoder_step(site):
                continue
            rank = self.Bt[site].shape[2]
            if shrunk_in_norm(site):  # each slot's B in columns after the weight's
                W_ext[site], A[site] = self.W_ext[site][:, :d_in + k * rank], self.A[site][:k]
            else:  # each slot's A in rows under the weight's, slot-major
                end = parts * (d_out + k * rank)
                W_ext[site] = self.W_ext[site][:end]
                b_ext[site] = None if self.b_ext[site] is None else self.b_ext[site][:end]
            Bt[site], ranks[site] = self.Bt[site][:k], self.ranks[site][:k]
        return A, W_ext, b_ext, Bt, ranks

    def _a_rows(self, site: Site) -> torch.Tensor:
        """Site's A stacks as [S, P, R, I]: the prefill's own tensor, or a view of the stacked weight's rows."""
        if site in self.A:
            return self.A[site]
        parts, d_in, d_out = self.shapes[site]
        return self.W_ext[site][parts * d_out:].view(self.slots, parts, -1, d_in)

    def active_sites(self, slots: set[int]) -> set[Site]:
        """The sites any of these slots adapts (skip every other site's LoRA work)."""
        return set().union(*(self.sites_of.get(s, set()) for s in slots)) if slots else set()

    def acquire(self, name: str) -> int | UnknownAdapter | None:
        """Slot of a resident adapter (ref taken); None while it loads or every slot is busy;
        the error if its files were refused."""
        if name in self.slot_of:
            slot = self.slot_of[name]
            self.refs[slot] += 1
            self.lru.remove(name)
            self.lru.append(name)
            return slot
        if name in self.failed:
            return self.failed[name]
        future = self._loading.get(name)
        if future is None:
            self._loading[name] = self._reader.submit(load_adapter, self.dir / name, self.cfg, self.max_rank)
            return None
        if not future.done():
            return None
        try:
            weights = future.result()
        except UnknownAdapter as exc:
            self._loading.pop(name)
            self.failed[name] = exc
            return exc
        if not self._make_room():
            return None
        self._loading.pop(name)
        self._install(weights)
        return self.acquire(name)

    def release(self, slot: int) -> None:
        self.refs[slot] -= 1

    def _make_room(self) -> bool:
        if self.free_slots:
            return True
        for name in self.lru:
            slot = self.slot_of[name]
            if self.refs[slot] == 0:
                self.lru.remove(name)
                del self.slot_of[name], self.refs[slot], self.sites_of[slot]
                self.free_slots.append(slot)
                log.info("adapter %s left slot %d (least recently used)", name, slot)
                return True
        return False

    def _install(self, weights: AdapterWeights) -> None:
        slot = self.free_slots.pop(0)
        for site in self.shapes:
            self._a_rows(site)[slot].zero_()
            self.Bt[site][slot].zero_()
            self.ranks[site][slot] = 0
        for site, parts in weights.parts.items():
            for part, (a, b) in parts.items():
                rank = a.shape[0]
                self._a_rows(site)[slot, part, :rank] = a.to(self.Bt[site].dtype)
                self.Bt[site][slot, part, :rank] = b.T.to(self.Bt[site].dtype)
            self.ranks[site][slot] = max(a.shape[0] for a, _ in parts.values())
        self.slot_of[weights.name] = slot
        self.sites_of[slot] = set(weights.parts)
        self.installed_sites = self.installed_sites.union(weights.parts)  # stays a (hashable) frozenset
        self.refs[slot] = 0
        self.lru.append(weights.name)
        log.info("adapter %s resident in slot %d (%d sites)", weights.name, slot, len(weights.parts))

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)


def aligned_slots(slots: int, rank: int) -> int:
    """`slots` rounded up so that slots x rank is a multiple of 64: the stacked weights' extra rows or columns
    (slots x rank a part) then fill cuBLAS's 64-wide tiles. At 256 rows, 33 slots of rank 16 took 1.4 us more
    than 32 or 36 for q|k|v's GEMM and 1.1 us more for fc1's."""
    unit = 64 // math.gcd(64, rank)
    return -(-slots // unit) * unit


def _stack_columns(layer: Linear, slots: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """layer's weight [O, I] followed by `slots * rank` zero columns (each slot's B, scaled); the layer's weight
    becomes a view of the first I columns. Returns the stacked weight and its Bt view [S, 1, R, O]."""
    out, d_in = layer.weight.shape
    weight = torch.zeros(out, d_in + slots * rank, dtype=layer.weight.dtype, device=layer.weight.device)
    weight[:, :d_in] = layer.weight
    layer.weight = weight[:, :d_in]
    return weight, weight[:, d_in:].view(out, slots, 1, rank).permute(1, 2, 3, 0)


def _stack(layer: Linear, extra: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """layer's weight [O', I] and bias stacked on `extra` zero rows (the slots' A, and the zero bias of their
    outputs); the layer's own tensors become views of their first rows."""
    weight = torch.zeros(layer.weight.shape[0] + extra, layer.weight.shape[1], dtype=layer.weight.dtype,
                         device=layer.weight.device)
    weight[:layer.weight.shape[0]] = layer.weight
    bias = None
    if layer.bias is not None:
        bias = torch.zeros(weight.shape[0], dtype=layer.bias.dtype, device=layer.bias.device)
        bias[:layer.bias.shape[0]] = layer.bias
        layer.bias = bias[:layer.bias.shape[0]]
    layer.weight = weight[:layer.weight.shape[0]]
    return weight, bias
