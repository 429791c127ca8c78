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
    """The JSON object in `path`; CheckpointError when the file is missing, unreadable or holds something else."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; a model directory needs config.json "
                              "(download the whole HF model folder)") from None
    except OSError as exc:  # the model "directory" is a file (Not a directory), the file a directory, unreadable
        raise CheckpointError(f"{path} cannot be read: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} holds a JSON {type(raw).__name__}, not an object")
    return raw


def _int(raw: dict, key: str, path: Path, minimum: int, default: int | None = None) -> int:
    """raw[key] (`default` when it is absent and there is one) as an int of at least `minimum`; KeyError when it is
    absent without a default."""
    value = raw[key] if default is None else raw.get(key, default)
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: JSON's Infinity
        raise CheckpointError(f"{path}: {key} is {value!r}, not an integer") from None
    if number < minimum:
        raise CheckpointError(f"{path}: {key} is {number}; it must be at least {minimum}")
    return number


def load_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    raw = _read_json(path)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{path} has model_type={model_type!r}; this engine runs NLLB-200 "
            f"dense checkpoints (model_type 'm2m_100'); NLLB-MoE and other architectures are not supported")
    if raw.get("activation_function", "relu") != "relu":
        raise CheckpointError(f"activation_function={raw['activation_function']!r} is not supported "
                              "(NLLB-200 uses relu)")
    try:
        cfg = ModelConfig(
            name=model_dir.resolve().name,
            vocab_size=_int(raw, "vocab_size", path, 1),
            d_model=_int(raw, "d_model", path, 1),
            encoder_layers=_int(raw, "encoder_layers", path, 1),
            decoder_layers=_int(raw, "decoder_layers", path, 1),
            encoder_heads=_int(raw, "encoder_attention_heads", path, 1),
            decoder_heads=_int(raw, "decoder_attention_heads", path, 1),
            encoder_ffn_dim=_int(raw, "encoder_ffn_dim", path, 1),
            decoder_ffn_dim=_int(raw, "decoder_ffn_dim", path, 1),
            max_position_embeddings=_int(raw, "max_position_embeddings", path, 1),
            scale_embedding=bool(raw.get("scale_embedding", True)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            pad_token_id=_int(raw, "pad_token_id", path, 0, default=1),
            bos_token_id=_int(raw, "bos_token_id", path, 0, default=0),
            eos_token_id=_int(raw, "eos_token_id", path, 0, default=2),
            decoder_start_token_id=_int(raw, "decoder_start_token_id", path, 0, default=2),
        )
    except KeyError as exc:
        raise CheckpointError(f"{path} lacks {exc.args[0]!r}; not an M2M100 config") from None
    if cfg.encoder_heads != cfg.decoder_heads or cfg.d_model % cfg.decoder_heads:
        raise CheckpointError(f"unsupported head layout: d_model={cfg.d_model}, encoder heads "
                              f"{cfg.encoder_heads}, decoder heads {cfg.decoder_heads}")
    return cfg


def load_generation_defaults(model_dir: Path) -> GenerationDefaults:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return GenerationDefaults()
    raw = _read_json(path)
    if not raw.get("max_length"):  # absent, null or 0: NLLB's own
        return GenerationDefaults()
    return GenerationDefaults(max_length=_int(raw, "max_length", path, 1))
