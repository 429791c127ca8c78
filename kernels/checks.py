"""Argument checks shared by the CUDA op wrappers (kernels/ops.py, ops_selection.py, ops_lora.py): each raises
ValueError naming the argument, so a caller's mistake reads as such rather than as a kernel fault."""
from __future__ import annotations

import torch

from kernels.limits import HEAD_DIMS

SUFFIX = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}  # kernel name suffix per dtype


def need_cuda(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda:
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")


def dtype_suffix(name: str, t: torch.Tensor) -> str:
    need_cuda(name, t)
    if t.dtype not in SUFFIX:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of bfloat16, float16, float32")
    return SUFFIX[t.dtype]


def need_like(name: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    need_cuda(name, t)
    if t.dtype != like.dtype:
        raise ValueError(f"{name} has dtype {t.dtype}; expected {like.dtype} like {like_name}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device}; expected {like.device} like {like_name}")


def need_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {tuple(t.stride())})")


def need_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")


def need_same(name: str, t: torch.Tensor, like: torch.Tensor, like_name: str, shape: tuple) -> None:
    """A contiguous tensor of `like`'s dtype and device, of this shape."""
    need_like(name, t, like, like_name)
    need_shape(name, t, shape)
    need_contiguous(name, t)


def need_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple) -> None:
    """A contiguous CUDA tensor of exactly this dtype and shape."""
    need_cuda(name, t)
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}; expected {dtype}")
    need_shape(name, t, shape)
    need_contiguous(name, t)


def need_index(name: str, t: torch.Tensor, n: int) -> None:
    """A contiguous CUDA int64 vector of n entries."""
    need_tensor(name, t, torch.int64, (n,))


def need_head_dim(name: str, d: int) -> None:
    if d not in HEAD_DIMS:
        raise ValueError(f"{name}: head dim {d} is not supported; the kernels need a power of two from 8 to 256")


def vec8(t: torch.Tensor) -> bool:
    """Rows of t can be read with 16-byte vectors of 8 elements (unit inner stride, aligned)."""
    elem = t.element_size()
    return (t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1])
            and t.data_ptr() % (8 * elem if elem == 2 else 16) == 0)


def heads(name: str, t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A [N, H, D] operand: any row/head strides with unit stride over D; copied only if misaligned."""
    need_cuda(name, t)
    need_shape(name, t, shape)
    return t if vec8(t) else t.contiguous()
