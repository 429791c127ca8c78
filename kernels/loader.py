"""One loader for the CUDA kernels: compile `kernels/cuda/*.cu` once per process, launch on torch's stream.

The sources are concatenated into one module (`common.cuh` first, then every `.cu` file in name
order), each preceded by `#line 1 "<file>"` so NVRTC errors name the real file and line. The module
is compiled with CuPy's `RawModule` (NVRTC, `-std=c++17`, `--gpu-architecture=sm_XY` from the current
device's compute capability) the first time a kernel is asked for, and cached for the process.

Launches go to torch's *current* stream, so they order with torch's own work and are captured inside
`torch.cuda.graph` alongside cuBLAS. Tensors are passed by `data_ptr()` (no copies); scalars as
explicitly sized numpy scalars.

On sm_90 and later every launch carries the programmatic-stream-serialization attribute (through the
driver's cuLaunchKernelEx, which CuPy does not expose): a kernel may then start while the one before
it in the stream still runs, and waits for it inside (`pdl_enter` in common.cuh, which every kernel
calls). At one row a decode step is ~150 short kernels, so their launch gaps, and the weight reads a
GEMV issues before its wait, overlap the kernel before. Stream capture keeps the attribute as a
programmatic edge of the CUDA graph. `PDL = False` launches through CuPy without it (for A/B timing).
"""
from __future__ import annotations

import ctypes
import functools
import struct
import threading
from pathlib import Path

import numpy as np

try:
    import cupy
except ImportError as exc:  # CI and CPU machines: kernels.ops raises ImportError, engine uses the references
    raise ImportError(f"CuPy is not installed ({exc}); the CUDA kernels need cupy-cuda13x") from exc

import torch

KERNEL_DIR = Path(__file__).parent / "cuda"
HEADER = "common.cuh"

_lock = threading.Lock()
_module = None
_pdl_available = False  # sm_90+ and a driver with cuLaunchKernelEx; set when the module is compiled
_kernels: dict[str, "cupy.RawKernel"] = {}
_streams: dict[int, "cupy.cuda.Stream"] = {}


def source_files() -> list[Path]:
    return [KERNEL_DIR / HEADER] + sorted(p for p in KERNEL_DIR.glob("*.cu"))


def source() -> str:
    """The whole module's source, every file behind a #line directive naming it."""
    parts = []
    for path in source_files():
        parts.append(f'#line 1 "{path}"\n')
        parts.append(path.read_text())
        parts.append("\n")
    return "".join(parts)


def compile_options() -> tuple[str, ...]:
    major, minor = torch.cuda.get_device_capability()
    cc = cupy.cuda.Device().compute_capability  # e.g. "90"; torch's answer checks they see the same GPU
    if cc != f"{major}{minor}":
        raise RuntimeError(f"CuPy sees compute capability {cc}, torch sees {major}.{minor}: different devices?")
    return ("-std=c++17", f"--gpu-architecture=sm_{cc}")


def sm90() -> bool:
    """Whether the current device is sm_90 or later: programmatic dependent launch and thread-block clusters
    (the kernels that use clusters compile only there)."""
    return torch.cuda.get_device_capability() >= (9, 0)


def module() -> "cupy.RawModule":
    """The compiled module (compiled on the first call; later calls return the cached one)."""
    global _module, _pdl_available
    if _module is None:
        with _lock:
            if _module is None:
                mod = cupy.RawModule(code=source(), options=compile_options(), backend="nvrtc")
                mod.compile()  # raise compile errors here, not at the first launch
                _pdl_available = sm90() and _driver_launch() is not None
                _module = mod
    return _module


def module_with_header(code: str) -> "cupy.RawModule":
    """Kernels outside the engine's module (a bench's, a test's) compiled on common.cuh, to be launched with
    `launch_kernel` as the engine's are. The engine's module compiles first: whether launches are programmatic
    is settled there."""
    module()
    return cupy.RawModule(code=(KERNEL_DIR / HEADER).read_text() + code, options=compile_options(),
                          backend="nvrtc")


def kernel(name: str) -> "cupy.RawKernel":
    k = _kernels.get(name)
    if k is None:
        k = module().get_function(name)
        _kernels[name] = k
    return k


class _TorchStream:
    """A torch stream handle speaking the CUDA stream protocol (`__cuda_stream__` -> (0, handle))."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def current_stream_handle() -> int:
    """torch's current stream on the current device, as a CUDA handle: the C calls under
    torch.cuda.current_stream(), whose Python device checks take longer (~10 us) than the launch itself."""
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


def _cupy_stream() -> "cupy.cuda.Stream":
    handle = current_stream_handle()
    s = _streams.get(handle)
    if s is None:
        if hasattr(cupy.cuda.Stream, "from_external"):
            s = cupy.cuda.Stream.from_external(_TorchStream(handle))
        else:  # older CuPy
            s = cupy.cuda.ExternalStream(handle)
        _streams[handle] = s
    return s


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute (cuda.h): id, pad to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig (cuda.h)
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_pdl_attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
_pdl_attribute.value[0] = 1  # programmaticStreamSerializationAllowed
_pdl_attributes = ctypes.pointer(_pdl_attribute)


@functools.cache
def driver_function(name: str) -> "ctypes._CFuncPtr | None":
    """A function of the CUDA driver (libcuda), or None where the driver lacks it (cached)."""
    try:
        fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int  # CUresult
    return fn


def _driver_launch() -> "ctypes._CFuncPtr | None":
    """The driver's cuLaunchKernelEx (CUDA 12+), or None where the driver lacks it."""
    fn = driver_function("cuLaunchKernelEx")
    if fn is not None:
        fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return fn


# each kernel argument in its own 8-byte slot; a 4-byte value at the slot's start (little-endian)
_SLOT_FORMAT = {"L": "Q", "Q": "Q", "l": "q", "q": "q", "i": "i4x", "f": "f4x"}
_slots = threading.local()


def _argument_slots(n: int) -> tuple[ctypes.Array, ctypes.Array]:
    """This thread's buffer of n 8-byte slots and the array of pointers to them (the driver copies the
    values at the launch, so the same buffer serves every launch)."""
    cache = _slots.__dict__.setdefault("by_count", {})
    if n not in cache:
        packed = ctypes.create_string_buffer(8 * n)
        base = ctypes.addressof(packed)
        cache[n] = packed, (ctypes.c_void_p * n)(*range(base, base + 8 * n, 8))
    return cache[n]


PDL: bool | None = None  # None: where the device and driver have it; False: CuPy's launch, for A/B timing


def programmatic() -> bool:
    """Whether launches are programmatic (set once the module is compiled; `PDL` overrides)."""
    return PDL if PDL is not None else _pdl_available


def _kernel_with_smem(name: str, shared_mem: int) -> "cupy.RawKernel":
    k = kernel(name)
    if shared_mem > 48 * 1024 and k.max_dynamic_shared_size_bytes < shared_mem:
        k.max_dynamic_shared_size_bytes = shared_mem  # opt in above the default 48 KB (once per kernel)
    return k


_active_clusters: dict[tuple, int] = {}


def max_active_clusters(name: str, cluster: tuple[int, int, int], block: tuple[int, ...], shared_mem: int,
                        fallback: int) -> int:
    """How many thread-block clusters of kernel `name` (of its compile-time shape `cluster`) the GPU runs
    at once with this block and dynamic shared memory: the driver's cuOccupancyMaxActiveClusters, or
    `fallback` where the driver lacks it. Cached per (name, block, shared_mem)."""
    key = (name, block, shared_mem)
    if key not in _active_clusters:
        k = _kernel_with_smem(name, shared_mem)
        count = ctypes.c_int(0)
        fn = driver_function("cuOccupancyMaxActiveClusters")
        config = _LaunchConfig(cluster, (*block, *(1,) * (3 - len(block))), shared_mem, None, None, 0)
        ok = fn is not None and fn(ctypes.byref(count), ctypes.c_void_p(k.kernel.ptr), ctypes.byref(config)) == 0
        _active_clusters[key] = count.value if ok and count.value > 0 else fallback
    return _active_clusters[key]


def launch(name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0) -> None:
    """Launch kernel `name` on torch's current stream (asynchronous, graph-capturable)."""
    launch_kernel(_kernel_with_smem(name, shared_mem), grid, block, args, shared_mem)


def launch_kernel(k: "cupy.RawKernel", grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
                  shared_mem: int = 0) -> None:
    """`launch` for a kernel of another module built on common.cuh (bench/kernels.py's grid barrier), once this
    module is compiled (it decides whether launches are programmatic)."""
    if not programmatic():
        with _cupy_stream():
            k(grid, block, args, shared_mem=shared_mem)
        return
    packed, params = _argument_slots(len(args))
    struct.pack_into("<" + "".join([_SLOT_FORMAT[a.dtype.char] for a in args]), packed, 0, *args)
    config = _LaunchConfig((*grid, *(1,) * (3 - len(grid))), (*block, *(1,) * (3 - len(block))), shared_mem,
                           current_stream_handle(), _pdl_attributes, 1)
    status = _driver_launch()(ctypes.byref(config), k.kernel.ptr, params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx({k.name}, grid {grid}, block {block}) failed: CUresult {status}")


# Argument helpers: CuPy passes numpy scalars by value with their exact width.
def ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def i32(x: int) -> np.int32:
    return np.int32(x)


def i64(x: int) -> np.int64:
    return np.int64(x)


def f32(x: float) -> np.float32:
    return np.float32(x)


def device_properties() -> tuple[int, int]:
    """(multiprocessor count, max shared memory per block) of the current device."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.multi_processor_count, getattr(props, "shared_memory_per_block", 48 * 1024)
