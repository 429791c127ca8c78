"""Model configuration read from a checkpoint's `config.json` and `generation_config.json`."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("m2m_100",)


@dataclass(frozen=True)
class ModelConfig:
    """The fields of an HF M2M100/NLLB `config.json` the engine uses."""

    name: str  # the model directory's name, reported in replies
    vocab_size: int
    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_heads: int
    decoder_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    max_position_embeddings: int
    scale_embedding: bool
    tie_word_embeddings: bool
    pad_token_id: int
    bos_token_id: int
    eos_token_id: int
    decoder_start_token_id: int
    layer_norm_eps: float = 1e-5  # torch.nn.LayerNorm's default, which M2M100 uses

    @property
    def head_dim(self) -> int:
        return self.d_model // self.decoder_heads


@dataclass(frozen=True)
class GenerationDefaults:
    """What `generation_config.json` sets; only max_length matters to NLLB (200 as shipped)."""

    max_length: int = 200


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; a model directory needs config.json "
                              "(download the whole HF model folder)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def load_config(model_dir: Path) -> ModelConfig:
    raw = _read_json(model_dir / "config.json")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{model_dir / 'config.json'} has model_type={model_type!r}; this engine runs NLLB-200 "
            f"dense checkpoints (model_type 'm2m_100'); NLLB-MoE and other architectures are not supported")
    if raw.get("activation_function", "relu") != "relu":
        raise CheckpointError(f"activation_function={raw['activation_function']!r} is not supported "
                              "(NLLB-200 uses relu)")
    try:
        cfg = ModelConfig(
            name=model_dir.resolve().name,
            vocab_size=int(raw["vocab_size"]),
            d_model=int(raw["d_model"]),
            encoder_layers=int(raw["encoder_layers"]),
            decoder_layers=int(raw["decoder_layers"]),
            encoder_heads=int(raw["encoder_attention_heads"]),
            decoder_heads=int(raw["decoder_attention_heads"]),
            encoder_ffn_dim=int(raw["encoder_ffn_dim"]),
            decoder_ffn_dim=int(raw["decoder_ffn_dim"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            scale_embedding=bool(raw.get("scale_embedding", True)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            pad_token_id=int(raw.get("pad_token_id", 1)),
            bos_token_id=int(raw.get("bos_token_id", 0)),
            eos_token_id=int(raw.get("eos_token_id", 2)),
            decoder_start_token_id=int(raw.get("decoder_start_token_id", 2)),
        )
    except KeyError as exc:
        raise CheckpointError(f"{model_dir / 'config.json'} lacks {exc.args[0]!r}; not an M2M100 config") from None
    if cfg.encoder_heads != cfg.decoder_heads or cfg.d_model % cfg.decoder_heads:
        raise CheckpointError(f"unsupported head layout: d_model={cfg.d_model}, encoder heads "
                              f"{cfg.encoder_heads}, decoder heads {cfg.decoder_heads}")
    return cfg


def load_generation_defaults(model_dir: Path) -> GenerationDefaults:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return GenerationDefaults()
    raw = _read_json(path)
    return GenerationDefaults(max_length=int(raw.get("max_length") or GenerationDefaults.max_length))
