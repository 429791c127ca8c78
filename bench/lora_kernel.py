"""The LoRA kernels alone at NLLB-600M site shapes, for Nsight Compute (where the time in a launch goes).

    ncu --clock-control none -k regex:lora --section SpeedOfLight --section WarpStateStats \\
        python3 -m bench.lora_kernel [--rows 256] [--adapters 8]

Each site (q|k|v, fc1, fc2) is launched `--repeat` times after one warm-up, rank 16, bf16, every row
adapted and the adapters interleaved (the decode batch's worst case: tiles of each adapter spread over
the batch). Timing in a step is test_timings' job (tests/kernels, graph-replayed); this only drives ncu.
"""
from __future__ import annotations

import argparse

import torch

from kernels import ops

D = 1024  # NLLB-600M d_model; the FFN is 4 * D
SITES = {"qkv": (3, D, D), "fc1": (1, D, 4 * D), "fc2": (1, 4 * D, D)}  # site -> (parts, in, out)


def site_inputs(parts: int, d_in: int, d_out: int, rows: int, adapters: int, rank: int,
                g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """ops.lora_apply's arguments for one site: every row adapted, adapters interleaved, bf16 stacks
    of rank `rank` (y, x, A, Bt, idx, ranks, tiles)."""
    slots = adapters + 1
    A = torch.randn(slots, parts, rank, d_in, device="cuda", generator=g).bfloat16()
    Bt = torch.randn(slots, parts, rank, d_out, device="cuda", generator=g).bfloat16()
    x = torch.randn(rows, d_in, device="cuda", generator=g).bfloat16()
    y = torch.randn(rows, parts * d_out, device="cuda", generator=g).bfloat16()
    idx = torch.arange(rows, device="cuda") % adapters + 1
    ranks = torch.full((slots,), rank, dtype=torch.int32, device="cuda")
    return y, x, A, Bt, idx, ranks, ops.lora_tiles(idx, slots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    for site, (parts, d_in, d_out) in SITES.items():
        inputs = site_inputs(parts, d_in, d_out, args.rows, args.adapters, args.rank, g)
        for _ in range(args.repeat + 1):
            ops.lora_apply(*inputs)
        torch.cuda.synchronize()
        print(f"{site}: {args.repeat + 1} launches, {args.rows} rows, {args.adapters} adapters, rank {args.rank}")


if __name__ == "__main__":
    main()
