"""Where a lora_apply_mma launch spends its time: the kernel timed (graph replay, test_timings' graph_time)
with everything after one stage cut off, for q|k|v and fc2 sites at 1 and 256 rows (rank 16, bf16).

    python3 -m bench.lora_stages      # on the GPU machine; bench/NOTES.md has the numbers

Each variant is the module's source with a `return` put after a stage (launch only; the tile record; the
staging batch; everything but the y stores), compiled on its own; the differences place the time. The
patches name lines of kernels/cuda/lora.cu: when the kernel changes, an assertion names the stale one.
"""
from __future__ import annotations

import cupy
import torch

from bench.lora_kernel import SITES, site_inputs
from kernels import loader, ops
from tests.kernels.test_kernels import graph_time

RECORD = "  if (!read_record(tiles, rec)) return;  // 1. (block-uniform)"
SHRINK = ("      if (rank == 0) return;  // block-uniform: this adapter leaves the site alone\n"
          "      for (int k = warp * 16")
VARIANTS = {  # name -> (line, replacement) patches
    "full": [],
    "launch": [(RECORD, "  if (threadIdx.x < 100000) return;\n" + RECORD)],
    "record": [(RECORD, RECORD + "\n  if (rec[LORA_TILE + 1] >= 0) return;")],
    "staged": [(SHRINK, SHRINK.replace("if (rank == 0) return;", "if (rank >= 0) return;"))],
    "no_store": [("  // 3. y += delta", "  if (rank >= 0) return;\n  // 3. y += delta")],
}
STAGE_SITES = ("qkv", "fc2")


def use_variant(patches: list[tuple[str, str]]) -> None:
    """Compile the patched module and make kernels.ops launch from it."""
    src = loader.source()
    for line, replacement in patches:
        assert line in src, f"lora.cu changed: no line {line!r}"
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
    for name, patches in VARIANTS.items():
        use_variant(patches)
        for site in STAGE_SITES:
            for rows, adapters in ((1, 1), (256, 8)):
                print(f"{name:9s} {site} N={rows:4d}: {time_site(*SITES[site], rows, adapters, g):6.2f} us", flush=True)


if __name__ == "__main__":
    main()
