"""Device selection: the CUDA kernels when a GPU and CuPy are there, the PyTorch references else.

Degrade, don't die: if `cuda` was asked for but the kernels cannot be set up, the reason is
logged once and the reference ops run on the GPU instead.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from engine.errors import InvalidRequest
from kernels import reference

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
    ops: ModuleType  # kernels.reference or kernels.ops: same functions, same signatures
    default_rows: int | None  # None: size the slot table from free device memory

    @property
    def capturable(self) -> bool:
        """CUDA graphs need the CUDA kernels: the reference ops read lengths on the host."""
        return self.device.type == "cuda" and self.ops is not reference


def select_backend(device: str = "auto", dtype: str | None = None) -> Backend:
    if device not in ("auto", "cpu", "cuda"):
        raise InvalidRequest(f"device={device!r}; expected auto, cuda or cpu")
    if dtype is not None and dtype not in DTYPES:
        raise InvalidRequest(f"dtype={dtype!r}; expected one of {sorted(DTYPES)}")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest("device='cuda' but torch sees no CUDA device; use device='cpu' or 'auto'")
    if not use_cuda:
        return Backend(torch.device("cpu"), DTYPES[dtype or "float32"], reference, default_rows=64)
    return Backend(torch.device("cuda"), DTYPES[dtype or "bfloat16"], _cuda_ops(), default_rows=None)


def _cuda_ops() -> ModuleType:
    try:
        from kernels import ops
        return ops
    except Exception as exc:  # no CuPy, or the kernels did not compile for this GPU
        log.error("CUDA kernels unavailable (%s); running the PyTorch reference ops on the GPU", exc)
        return reference
