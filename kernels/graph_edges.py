"""Programmatic edges into cuBLAS's GEMM kernels of a captured CUDA graph.

Our kernels are launched with programmatic dependent launch (loader.launch): each may start while the kernel
before it still runs, and waits inside (pdl_enter); stream capture keeps that as a programmatic edge. cuBLAS
launches its kernels without the attribute, so as captured every GEMM of a decode step starts only once the
kernel before it has ended, plus a launch (~1 us a GEMM on the H200). cuBLAS's sm90 GEMM kernels (`nvjet_sm90_*`)
wait for the grid before them inside (griddepcontrol.wait) before they read their input: behind a
programmatic edge, a GEMM whose input the kernel before writes 20 us late still reads all of it, where a torch
elementwise kernel reads it early (tests/kernels/test_graph_edges.py). So `programmatic_graph` turns the edge
into each such GEMM from a kernel that is not cuBLAS's programmatic and launches the graph itself through the
driver's graph API, torch's CUDAGraph keeping the captured memory. An edge from another cuBLAS kernel (fc1's
GEMM before fc2's) stays as it is: what cuBLAS kernels do before their wait (a workspace) is not known.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

from kernels import loader

log = logging.getLogger("engine")

GEMM_PREFIX = "nvjet_sm90"  # cuBLAS's kernels known to wait inside (the test above)
CHECKED_CUDA = 13  # the test above ran on CUDA 13's cuBLAS; an older one's kernels are not known to wait
_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
_PORT_PROGRAMMATIC = 1  # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC: the kernel before has let dependents start
_EDGE_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData (cuda.h)
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h)
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def _driver(name: str) -> "ctypes._CFuncPtr":
    """The driver's function `name` (its _v2 where there is one), or RuntimeError where it lacks both."""
    fn = loader.driver_function(name + "_v2") or loader.driver_function(name)
    if fn is None:
        raise RuntimeError(f"the CUDA driver has no {name}")
    return fn


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: CUresult {status}")


def is_cublas(name: str) -> bool:
    """Whether a kernel is cuBLAS's: its sm90 and older GEMM families, or a name in its namespace."""
    return name.startswith(("nvjet", "sm90_xmma", "sm80_xmma", "cutlass")) or "cublas" in name.lower()


def kernel_name(node: int) -> str | None:
    """The name of a kernel node's function (None for another kind of node or a name the driver withholds)."""
    kind = ctypes.c_int()
    _check(_driver("cuGraphNodeGetType")(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
    if kind.value != _KERNEL_NODE:
        return None
    params = _KernelNodeParams()
    _check(_driver("cuGraphKernelNodeGetParams")(ctypes.c_void_p(node), ctypes.byref(params)),
           "cuGraphKernelNodeGetParams")
    name = ctypes.c_char_p()
    if params.func and _driver("cuFuncGetName")(ctypes.byref(name), ctypes.c_void_p(params.func)) == 0:
        return name.value.decode()
    get_name = loader.driver_function("cuKernelGetName")
    if params.kern and get_name is not None and get_name(ctypes.byref(name), ctypes.c_void_p(params.kern)) == 0:
        return name.value.decode()
    return None


def edges(graph: int) -> list[tuple[int, int, _EdgeData]]:
    """Every edge of a graph (cudaGraph_t) as (from node, to node, its data)."""
    get = _driver("cuGraphGetEdges")
    count = ctypes.c_size_t(0)
    _check(get(ctypes.c_void_p(graph), None, None, None, ctypes.byref(count)), "cuGraphGetEdges")
    n = count.value
    frm, to, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (_EdgeData * n)()
    _check(get(ctypes.c_void_p(graph), frm, to, data, ctypes.byref(count)), "cuGraphGetEdges")
    return [(frm[i], to[i], data[i]) for i in range(count.value)]


def programmatic_gemm_edges(graph: int) -> int:
    """Make every plain edge into a `GEMM_PREFIX` kernel from a kernel that is not cuBLAS's programmatic;
    returns how many."""
    remove, add = _driver("cuGraphRemoveDependencies"), _driver("cuGraphAddDependencies")
    name = functools.cache(kernel_name)  # a node's name, looked up once however many edges it has
    changed = 0
    for frm, to, data in edges(graph):
        before, after = name(frm), name(to)
        if (data.type == _EDGE_PROGRAMMATIC or before is None or after is None or not after.startswith(GEMM_PREFIX)
                or is_cublas(before)):
            continue
        one_from, one_to = (ctypes.c_void_p * 1)(frm), (ctypes.c_void_p * 1)(to)
        _check(remove(ctypes.c_void_p(graph), one_from, one_to, (_EdgeData * 1)(data), ctypes.c_size_t(1)),
               "cuGraphRemoveDependencies")
        programmatic = (_EdgeData * 1)()
        programmatic[0].from_port, programmatic[0].type = _PORT_PROGRAMMATIC, _EDGE_PROGRAMMATIC
        _check(add(ctypes.c_void_p(graph), one_from, one_to, programmatic, ctypes.c_size_t(1)),
               "cuGraphAddDependencies")
        changed += 1
    return changed


class ProgrammaticGraph:
    """A captured graph (torch's CUDAGraph, captured with keep_graph=True, which keeps its memory) whose edges
    into cuBLAS's GEMMs are programmatic, launched on torch's current stream by `replay` as torch's is.
    `edges`: how many edges were made programmatic; where none was (a graph without a GEMM: one sentence's step)
    nothing is instantiated and `programmatic_graph` keeps torch's graph."""

    def __init__(self, graph: torch.cuda.CUDAGraph):
        self._exec = ctypes.c_void_p()
        self._launch, self._destroy = _driver("cuGraphLaunch"), _driver("cuGraphExecDestroy")
        self.graph = graph
        clone = ctypes.c_void_p()  # torch's graph stays as captured, for torch to launch if this fails
        _check(_driver("cuGraphClone")(ctypes.byref(clone), ctypes.c_void_p(graph.raw_cuda_graph())), "cuGraphClone")
        try:
            self.edges = programmatic_gemm_edges(clone.value)
            if self.edges:
                _check(_driver("cuGraphInstantiateWithFlags")(ctypes.byref(self._exec), clone,
                                                              ctypes.c_ulonglong(0)), "cuGraphInstantiateWithFlags")
        finally:
            _driver("cuGraphDestroy")(clone)

    def replay(self) -> None:
        _check(self._launch(self._exec, ctypes.c_void_p(loader.current_stream_handle())), "cuGraphLaunch")

    def __del__(self) -> None:
        if self._exec:
            self._destroy(self._exec)
            self._exec = ctypes.c_void_p()


def cublas_checked(cuda_version: str | None) -> bool:
    """Whether torch's CUDA (its version, torch.version.cuda) brings a cuBLAS of the kind the test checked."""
    try:
        return int((cuda_version or "").split(".")[0]) >= CHECKED_CUDA
    except ValueError:
        return False


_failed: str | None = None  # why the driver took no programmatic graph (then every graph stays torch's)


def programmatic_graph(graph: torch.cuda.CUDAGraph) -> ProgrammaticGraph | torch.cuda.CUDAGraph:
    """The graph (captured with keep_graph=True) launched with programmatic edges into its GEMMs, where launches
    are programmatic, the cuBLAS is of the checked kind, the graph has such an edge and the driver takes them;
    else torch's own graph, instantiated here rather than at its first replay (a driver failure logged once)."""
    global _failed
    if _failed is None and loader.programmatic() and cublas_checked(torch.version.cuda):
        try:
            programmatic = ProgrammaticGraph(graph)
            if programmatic.edges:
                return programmatic
        except RuntimeError as exc:
            _failed = str(exc)
            log.warning("CUDA graphs launched without programmatic edges into their GEMMs from now on (%s)", exc)
    graph.instantiate()
    return graph
