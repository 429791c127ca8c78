"""Device selection: the CUDA kernels when a GPU and CuPy are there, the PyTorch references else.

Degrade, don't die: if `cuda` was asked for but the kernels cannot be set up, the reason is
logged once and the reference ops run on the GPU instead; where a model's shapes are ones some
kernel cannot take, that op alone runs its reference (Backend.for_model, kernels/support.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from types import ModuleType

import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import CheckpointError, InvalidRequest
from kernels import reference
from kernels.support import ModelShapes, unrunnable, unsupported_ops

log = logging.getLogger("engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without a stream sync: a blocking copy waits for all queued GPU work
    (a step in flight), an asynchronous one from pageable memory only stages the bytes at the call, so
    the array may go at once and the copy runs in stream order. On the CPU: the array's own memory."""
    return torch.from_numpy(array).to(device, non_blocking=True)


@dataclass(frozen=True)
class Backend:
    device: torch.device
    dtype: torch.dtype
    ops: ModuleType  # kernels.reference, kernels.ops, or kernels.ops with some reference ops: same signatures
    fallbacks: dict[str, str] = field(default_factory=dict)  # op -> why its reference stands in for the kernel

    @property
    def capturable(self) -> bool:
        """CUDA graphs need the CUDA kernels, every one: the reference ops read lengths on the host."""
        return self.device.type == "cuda" and self.ops is not reference and not self.fallbacks

    def for_model(self, cfg: ModelConfig) -> "Backend":
        """This backend for a model of cfg's shapes. CheckpointError for shapes that no path runs; where a CUDA
        kernel cannot take them, its reference op in its place (logged once, with the reason), and no CUDA
        graphs then. Unchanged where every kernel runs them, or on the reference ops already."""
        shapes = ModelShapes.of(cfg)
        refusals = unrunnable(shapes)
        if refusals:
            raise CheckpointError(f"{cfg.name}: " + "; ".join(refusals))
        fallbacks = unsupported_ops(shapes) if self.ops is not reference else {}
        if not fallbacks:
            return self
        by_reason: dict[str, list[str]] = {}
        for op, why in fallbacks.items():
            by_reason.setdefault(why, []).append(op)
        log.warning("the CUDA kernels cannot run model %s: %s. These ops run their PyTorch reference on %s "
                    "instead (slower, and no CUDA graphs)", cfg.name,
                    " | ".join(f"{', '.join(ops)}: {why}" for why, ops in by_reason.items()), self.device)
        return replace(self, ops=_mixed_ops(self.ops, fallbacks), fallbacks=fallbacks)


# A model whose largest weight has fewer elements than this runs each CPU op in microseconds: an op split over
# threads costs more in hand-offs than it saves, and the idle OpenMP threads spin on cores that the rest of the
# process needs (the toy model's largest weight: 29k elements; the 600M shape's LM head: 262M). One thread ran
# the toy engine at 0.19 ms of CPU a job against 0.56 on two (docs/performance.md, "The worker's per-job path").
SMALL_MODEL_WEIGHT = 1 << 18


def cpu_threads_for(cfg: ModelConfig) -> int | None:
    """The threads torch's CPU ops should use for this model: 1 for a small one (SMALL_MODEL_WEIGHT), None for
    torch's default (one a core) otherwise."""
    largest = max(cfg.vocab_size * cfg.d_model, 3 * cfg.d_model * cfg.d_model,
                  cfg.d_model * max(cfg.encoder_ffn_dim, cfg.decoder_ffn_dim))
    return 1 if largest < SMALL_MODEL_WEIGHT else None


def select_backend(device: str = "auto", dtype: str | None = None) -> Backend:
    if device not in ("auto", "cpu", "cuda"):
        raise InvalidRequest(f"device={device!r}; expected auto, cuda or cpu")
    if dtype is not None and dtype not in DTYPES:
        raise InvalidRequest(f"dtype={dtype!r}; expected one of {sorted(DTYPES)}")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest("device='cuda' but torch sees no CUDA device; use device='cpu' or 'auto'")
    if not use_cuda:
        return Backend(torch.device("cpu"), DTYPES[dtype or "float32"], reference)
    return Backend(torch.device("cuda"), DTYPES[dtype or "bfloat16"], _cuda_ops())


def _cuda_ops() -> ModuleType:
    try:
        from kernels import ops
        return ops
    except Exception as exc:  # no CuPy, or the kernels did not compile for this GPU
        log.error("CUDA kernels unavailable (%s); running the PyTorch reference ops on the GPU", exc)
        return reference


def _mixed_ops(kernel_ops: ModuleType, fallbacks: dict[str, str]) -> ModuleType:
    """What `kernel_ops` offers, but the reference's function for each op in `fallbacks`."""
    ops = ModuleType(f"{kernel_ops.__name__} with the reference's {', '.join(fallbacks)}")
    ops.__dict__.update((name, value) for name, value in vars(kernel_ops).items() if not name.startswith("__"))
    for op in fallbacks:
        setattr(ops, op, getattr(reference, op))
    return ops
