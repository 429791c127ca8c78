"""kernels/graph_edges.py: a captured graph's edges into cuBLAS's GEMMs made programmatic. A kernel of ours lets
the next kernel start at once and writes the GEMM's input ~20 us later; behind the programmatic edge the GEMM
must still read all of it, every replay, as the engine's decode and prefill graphs rely on. A torch elementwise
kernel behind the same edge reads early, which shows the check can fail. GPU only (`pytest -m gpu`)."""
from __future__ import annotations

import pytest
import torch

from engine.graphs import capture
from tests.kernels.gpu import DEV, gen, needs_ops, randn

pytestmark = pytest.mark.gpu

LATE_WRITE = r'''
extern "C" __global__ void late_write(__nv_bfloat16* x, int n, long long spin) {
  pdl_enter();  // lets the next kernel start now
  const long long t0 = clock64();
  while (clock64() - t0 < spin) {
  }
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] = __float2bfloat16(1.f);
}
'''
SPIN = 40_000  # cycles, ~20 us


def late_writer():
    """x := 1 from a kernel of ours that lets its successor start before it writes (launched as loader.launch)."""
    from kernels import loader
    kernel = loader.module_with_header(LATE_WRITE).get_function("late_write")
    return lambda x: loader.launch_kernel(kernel, (132,), (256,), (loader.ptr(x), loader.i32(x.numel()),
                                                                    loader.i64(SPIN)))


def gemm_op(kind: str, d_in: int, d_out: int, g):
    """x -> the product of a random [d_out, d_in] bf16 weight as the engine takes it: "mm" (the LM head, no bias),
    "linear_bias" (a projection), "linear_relu" (fc1, the ReLU in cuBLASLt's epilogue)."""
    W, b = randn(d_out, d_in, dtype=torch.bfloat16, g=g, scale=0.02), randn(d_out, dtype=torch.bfloat16, g=g)
    return {"mm": lambda x: x @ W.t(), "linear_bias": lambda x: torch.nn.functional.linear(x, W, b),
            "linear_relu": lambda x: torch._addmm_activation(b, x, W.t())}[kind]


def replays_reading_early(graph, x: torch.Tensor, y: torch.Tensor, want: torch.Tensor, runs: int = 10) -> int:
    """How many of `runs` replays, each from x = 0, left y other than `want`."""
    wrong = 0
    for _ in range(runs):
        x.zero_()
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        wrong += not torch.equal(y, want)
    return wrong


@needs_ops
@pytest.mark.parametrize("gemm", ["mm", "linear_bias", "linear_relu"])
@pytest.mark.parametrize("shape", [(256, 1024, 1024), (256, 2048, 2048), (1024, 1024, 4096)])
def test_a_gemm_behind_a_programmatic_edge_reads_what_the_kernel_before_wrote_late(gemm, shape):
    from kernels import graph_edges, loader
    if not loader.programmatic():
        pytest.skip("launches are not programmatic on this device")
    rows, d_in, d_out = shape
    g = gen(rows + d_in + d_out)
    op = gemm_op(gemm, d_in, d_out, g)
    x = torch.zeros(rows, d_in, dtype=torch.bfloat16, device=DEV)
    want = op(torch.ones_like(x))
    write = late_writer()
    graph, y = capture(lambda: (write(x), op(x))[1], None)
    assert isinstance(graph, graph_edges.ProgrammaticGraph) and graph.edges == 1
    assert replays_reading_early(graph, x, y, want) == 0


# The products a decode step hands cuBLAS, each behind a kernel of ours there: 600M's and 3.3B's q|k|v, out and
# cross out, fc1 with its ReLU and fc2 (d_in, d_out, kind), at each row bucket cuBLAS takes (17 rows and more;
# from 9 for a weight over MMA_WIDE_MAX_WEIGHT elements, kernels/ops_linear.py mma_takes), and the LM head.
STEP_PRODUCTS = [(1024, 3072, "linear_bias"), (1024, 1024, "linear_bias"), (1024, 4096, "linear_relu"),
                 (4096, 1024, "linear_bias"), (2048, 6144, "linear_bias"), (2048, 2048, "linear_bias"),
                 (2048, 8192, "linear_relu"), (8192, 2048, "linear_bias")]
STEP_CASES = ([(rows, *p) for rows in (32, 64, 128, 256, 512, 1024) for p in STEP_PRODUCTS]
              + [(16, *p) for p in STEP_PRODUCTS if p[0] * p[1] > 8 << 20]
              + [(rows, 1024, 256256, "mm") for rows in (256, 1024)])


@needs_ops
@pytest.mark.parametrize("rows, d_in, d_out, gemm", STEP_CASES)
def test_every_product_a_step_gives_cublas_reads_what_the_kernel_before_wrote_late(rows, d_in, d_out, gemm):
    """Whichever kernel cuBLAS picks for the shape (an edge into one that is not `GEMM_PREFIX`'s stays plain), the
    product behind a late writer of ours reads all of it, every replay: the three shapes above are not every
    kernel the engine's graphs hold."""
    from kernels import loader
    if not loader.programmatic():
        pytest.skip("launches are not programmatic on this device")
    op = gemm_op(gemm, d_in, d_out, gen(rows + d_in + d_out))
    x = torch.zeros(rows, d_in, dtype=torch.bfloat16, device=DEV)
    want = op(torch.ones_like(x))
    write = late_writer()
    graph, y = capture(lambda: (write(x), op(x))[1], None)
    assert replays_reading_early(graph, x, y, want) == 0


@needs_ops
def test_a_torch_kernel_behind_a_programmatic_edge_reads_early(monkeypatch):
    """The check above can fail: torch's kernels do not wait, so behind the same edge one reads x before the late
    write (graph_edges would never give it one: it is not cuBLAS's)."""
    from kernels import graph_edges, loader
    if not loader.programmatic():
        pytest.skip("launches are not programmatic on this device")
    x = torch.zeros(256, 1024, dtype=torch.bfloat16, device=DEV)
    write = late_writer()
    graph, y = capture(lambda: (write(x), x * 2)[1], None)
    assert not isinstance(graph, graph_edges.ProgrammaticGraph)  # no GEMM of cuBLAS's: torch's own graph
    assert replays_reading_early(graph, x, y, torch.full_like(y, 2.0)) == 0  # its edge plain: x read when written
    monkeypatch.setattr(graph_edges, "GEMM_PREFIX", "")  # every kernel taken for one
    graph, y = capture(lambda: (write(x), x * 2)[1], None)
    assert graph.edges == 1
    assert replays_reading_early(graph, x, y, torch.full_like(y, 2.0)) > 0


@needs_ops
def test_only_a_cublas_of_the_checked_kind_gets_programmatic_edges():
    """The edges rely on the checked cuBLAS's kernels waiting inside: an older CUDA's cuBLAS keeps plain edges."""
    from kernels.graph_edges import cublas_checked
    assert cublas_checked("13.0") and cublas_checked("13.2") and cublas_checked("14.1")
    assert not cublas_checked("12.9") and not cublas_checked("11.8")
    assert not cublas_checked(None) and not cublas_checked("")
