"""Where a LoRA launch spends its time, v7 (lora_apply_mma) and v9 (lora_apply_cluster): the kernel timed
(graph replay, test_timings' graph_time) with everything after one stage cut off, for q|k|v and fc2 sites
at 1 and 256 rows (rank 16, bf16).

    python3 -m bench.lora_stages      # on the GPU machine; bench/NOTES.md has the numbers

Each variant is the module's source with a `return` put after a stage (launch only; the tile record; the
staging batch; v9: the cluster's sum of h; everything but the y stores), compiled on its own; the
differences place the time. v9's cuts after the cluster barrier wait on it first, as the kernel does
before it exits. The patches name lines of kernels/cuda/lora.cu, each found exactly once: when the
kernel changes, an assertion names the stale one.
"""
from __future__ import annotations

import cupy
import torch

from bench.lora_kernel import SITES, site_inputs
from kernels import loader, ops, ops_lora
from tests.kernels.test_kernels import graph_time

RECORD = "  if (!read_record(tiles, blockIdx.x, rec)) return;  // 1. (block-uniform)"
SHRINK = ("      if (rank == 0) return;  // block-uniform: this adapter leaves the site alone\n"
          "      for (int k = warp * 16")
STORE = "  // 3. y += delta, rounded once, straight from the accumulators"
RECORD9 = "  if (!read_record(tiles, k, rec)) return false;  // 1. (cluster-uniform: one record a cluster)"
SHRINK9 = "    if (*rank == 0) return false;  // cluster-uniform: this adapter leaves the site alone"
SUM9 = "    lora_cluster_sum<T>(hsum, wpart, part[r0 / LORA_RC], hi, lo, r0, rank, last);"
STORE9 = "  // 3. y += delta rounded once, 8 bytes a lane and row"
EXIT9 = "    cluster_wait();\n    return true;\n"  # the other blocks may still be reading this one's share of h
VARIANTS = {  # ops_lora.LORA_KERNEL -> name -> (line, replacement) patches
    "mma": {
        "full": [],
        "launch": [(RECORD, "  if (threadIdx.x < 100000) return;\n" + RECORD)],
        "record": [(RECORD, RECORD + "\n  if (rec[LORA_TILE + 1] >= 0) return;")],
        "staged": [(SHRINK, SHRINK.replace("if (rank == 0) return;", "if (rank >= 0) return;"))],
        "no_store": [(STORE, "  if (rank >= 0) return;\n" + STORE)],
    },
    "cluster": {
        "full": [],
        "launch": [(RECORD9, "  if (threadIdx.x < 100000) return false;\n" + RECORD9)],
        "record": [(RECORD9, RECORD9 + "\n  if (rec[LORA_TILE + 1] >= 0) return true;")],
        "staged": [(SHRINK9, SHRINK9.replace("if (*rank == 0)", "if (*rank >= 0)"))],
        "summed": [(SUM9, SUM9 + "\n    if (rank >= 0) {\n      if (!last) cluster_arrive();\n" + EXIT9 + "    }")],
        "no_store": [(STORE9, "  if (rank >= 0) {\n" + EXIT9 + "  }\n" + STORE9)],
    },
}
STAGE_SITES = ("qkv", "fc2")


def use_variant(patches: list[tuple[str, str]]) -> None:
    """Compile the patched module and make kernels.ops launch from it."""
    src = loader.source()
    for line, replacement in patches:
        assert src.count(line) == 1, f"lora.cu changed: {src.count(line)} lines {line!r}"
        src = src.replace(line, replacement)
    module = cupy.RawModule(code=src, options=loader.compile_options(), backend="nvrtc")
    module.compile()
    loader._module = module
    loader._kernels.clear()


def time_site(parts: int, d_in: int, d_out: int, rows: int, adapters: int, g: torch.Generator) -> float:
    """Microseconds a launch, every row adapted, adapters interleaved, rank 16."""
    inputs = site_inputs(parts, d_in, d_out, rows, adapters, 16, g)
    return graph_time(lambda: ops.lora_apply(*inputs)) * 1e3


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for kernel, variants in VARIANTS.items():
        ops_lora.LORA_KERNEL = kernel
        for name, patches in variants.items():
            use_variant(patches)
            for site in STAGE_SITES:
                for rows, adapters in ((1, 1), (256, 8)):
                    us = time_site(*SITES[site], rows, adapters, g)
                    print(f"{kernel:7s} {name:9s} {site} N={rows:4d}: {us:6.2f} us", flush=True)


if __name__ == "__main__":
    main()
