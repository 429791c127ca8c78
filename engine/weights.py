"""Checkpoint loading: safetensors (single or sharded) in HF M2M100 naming, into fused layouts.

HF has saved M2M100/NLLB weights under several names over the years: with or without the
`model.` prefix, the embedding as `shared` or as per-stack `embed_tokens`, `lm_head.weight`
present or tied. All of them load; anything missing or misshapen is an error naming the file
and tensor. Pickled `pytorch_model.bin` checkpoints are converted once by `convert_pytorch_bin`;
nothing else in the product unpickles.
"""
from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LM_HEAD_ROWS = 64  # the LM head's rows are padded to a multiple of this (padded_head)


@dataclass
class Linear:
    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None  # [out]


@dataclass
class EncoderLayer:
    attn_norm: tuple[torch.Tensor, torch.Tensor]  # LayerNorm (weight, bias), [d] each
    qkv: Linear  # fused q|k|v projection, [3d, d]
    out: Linear  # [d, d]
    ffn_norm: tuple[torch.Tensor, torch.Tensor]
    fc1: Linear  # [ffn, d]
    fc2: Linear  # [d, ffn]


@dataclass
class DecoderLayer(EncoderLayer):
    cross_norm: tuple[torch.Tensor, torch.Tensor]
    cross_q: Linear  # [d, d]
    cross_kv: Linear  # fused k|v over the encoder output, [2d, d]
    cross_out: Linear  # [d, d]


@dataclass
class Weights:
    embed: torch.Tensor  # [V, d] shared token embedding (unscaled)
    lm_head: torch.Tensor  # [V', d], V' >= V: zero rows past V (see padded_head); embed is its first V rows when tied
    encoder: list[EncoderLayer]
    encoder_norm: tuple[torch.Tensor, torch.Tensor]
    decoder: list[DecoderLayer]
    decoder_norm: tuple[torch.Tensor, torch.Tensor]


class _TensorSource:
    """Name → tensor over one or several safetensors files, `model.` prefix optional."""

    def __init__(self, model_dir: Path):
        self.files: dict[str, Path] = {}
        if (model_dir / INDEX_FILE).exists():
            index = json.loads((model_dir / INDEX_FILE).read_text())
            for name, file in index.get("weight_map", {}).items():
                self.files[_strip(name)] = model_dir / file
        elif (model_dir / SINGLE_FILE).exists():
            for name in _keys(model_dir / SINGLE_FILE):
                self.files[_strip(name)] = model_dir / SINGLE_FILE
        elif (model_dir / "pytorch_model.bin").exists():
            raise CheckpointError(
                f"{model_dir} holds only pytorch_model.bin; convert it once with "
                f"`nllb-worker convert {model_dir}` (the worker never unpickles)")
        else:
            raise CheckpointError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._handles: dict[Path, object] = {}
        self._raw_names = {path: {_strip(k): k for k in _keys(path)} for path in set(self.files.values())}

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if name not in self.files:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint "
                                  f"(looked in {sorted({p.name for p in self.files.values()})})")
        path = self.files[name]
        handle = self._handles.get(path) or self._handles.setdefault(path, safe_open(path, "pt"))
        raw = self._raw_names[path].get(name)
        if raw is None:
            raise CheckpointError(f"{INDEX_FILE} maps {name!r} to {path.name}, which does not hold it")
        tensor = handle.get_tensor(raw)
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"tensor {raw!r} in {path.name} has shape {tuple(tensor.shape)}, "
                                  f"expected {shape} from config.json")
        return tensor.to(dtype)


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _keys(path: Path) -> list[str]:
    try:
        with safe_open(path, "pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None


def load_weights(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> Weights:
    src = _TensorSource(model_dir)
    d, V = cfg.d_model, cfg.vocab_size

    def lin(prefix: str, out_dim: int, in_dim: int) -> Linear:
        return Linear(src.get(f"{prefix}.weight", (out_dim, in_dim), dtype),
                      src.get(f"{prefix}.bias", (out_dim,), dtype))

    def norm(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        return src.get(f"{prefix}.weight", (d,), dtype), src.get(f"{prefix}.bias", (d,), dtype)

    def fuse(*parts: Linear) -> Linear:
        return Linear(torch.cat([p.weight for p in parts]), torch.cat([p.bias for p in parts]))

    def encoder_layer(p: str, ffn: int) -> dict:
        return dict(
            attn_norm=norm(f"{p}.self_attn_layer_norm"),
            qkv=fuse(*(lin(f"{p}.self_attn.{x}_proj", d, d) for x in "qkv")),
            out=lin(f"{p}.self_attn.out_proj", d, d),
            ffn_norm=norm(f"{p}.final_layer_norm"),
            fc1=lin(f"{p}.fc1", ffn, d), fc2=lin(f"{p}.fc2", d, ffn))

    embed_name = next((n for n in ("shared.weight", "encoder.embed_tokens.weight",
                                   "decoder.embed_tokens.weight") if src.has(n)), "shared.weight")
    embed = src.get(embed_name, (V, d), dtype)
    tied = cfg.tie_word_embeddings or not src.has("lm_head.weight")
    lm_head = padded_head(embed if tied else src.get("lm_head.weight", (V, d), dtype))
    if tied:
        embed = lm_head[:V]  # one copy of the tied matrix (a contiguous view)
    encoder = [EncoderLayer(**encoder_layer(f"encoder.layers.{i}", cfg.encoder_ffn_dim))
               for i in range(cfg.encoder_layers)]
    decoder = []
    for i in range(cfg.decoder_layers):
        p = f"decoder.layers.{i}"
        decoder.append(DecoderLayer(
            **encoder_layer(p, cfg.decoder_ffn_dim),
            cross_norm=norm(f"{p}.encoder_attn_layer_norm"),
            cross_q=lin(f"{p}.encoder_attn.q_proj", d, d),
            cross_kv=fuse(lin(f"{p}.encoder_attn.k_proj", d, d), lin(f"{p}.encoder_attn.v_proj", d, d)),
            cross_out=lin(f"{p}.encoder_attn.out_proj", d, d)))
    weights = _to_device(Weights(None, None, encoder, norm("encoder.layer_norm"), decoder, norm("decoder.layer_norm")),
                         device)
    weights.lm_head = lm_head.to(device)
    weights.embed = weights.lm_head[:V] if tied else embed.to(device).contiguous()
    return weights


def padded_head(lm_head: torch.Tensor) -> torch.Tensor:
    """The LM head with zero rows appended up to a multiple of LM_HEAD_ROWS. The logits then have an
    aligned row stride, which lets cuBLAS take its fast kernels: at V = 256206 it fell back to an
    align-2 kernel that took 2.0 ms of a 5.4 ms decode step at 1024 rows."""
    rows, d = lm_head.shape
    padded = -(-rows // LM_HEAD_ROWS) * LM_HEAD_ROWS
    if padded == rows:
        return lm_head.contiguous()
    out = torch.zeros(padded, d, dtype=lm_head.dtype)
    out[:rows] = lm_head
    return out


def _to_device(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device).contiguous()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(x, device) for x in obj)
    if hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            setattr(obj, name, _to_device(getattr(obj, name), device))
    return obj


def convert_pytorch_bin(model_dir: Path) -> Path:
    """Convert `pytorch_model.bin` (or its sharded index) to `model.safetensors`, once.

    Loads with `weights_only=True`, so a hostile pickle cannot run code. Tied tensors that share
    storage are written once each under their own names (safetensors forbids shared storage).
    """
    bins = sorted(model_dir.glob("pytorch_model*.bin"))
    if not bins:
        raise CheckpointError(f"{model_dir} has no pytorch_model*.bin to convert")
    tensors: dict[str, torch.Tensor] = {}
    for path in bins:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"{path} holds more than tensors (refused, it could run code on load): "
                                  f"{str(exc).splitlines()[0]}") from None
        if not isinstance(state, dict):
            raise CheckpointError(f"{path} does not hold a state dict")
        tensors.update({k: v.detach().clone().contiguous() for k, v in state.items()
                        if isinstance(v, torch.Tensor)})
    out = model_dir / SINGLE_FILE
    save_file(tensors, str(out), metadata={"format": "pt"})
    return out
