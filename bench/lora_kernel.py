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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    slots = args.adapters + 1
    idx = torch.arange(args.rows, device="cuda") % args.adapters + 1
    ranks = torch.full((slots,), args.rank, dtype=torch.int32, device="cuda")
    for site, (parts, d_in, d_out) in SITES.items():
        A = torch.randn(slots, parts, args.rank, d_in, device="cuda", generator=g).bfloat16()
        Bt = torch.randn(slots, parts, args.rank, d_out, device="cuda", generator=g).bfloat16()
        x = torch.randn(args.rows, d_in, device="cuda", generator=g).bfloat16()
        y = torch.randn(args.rows, parts * d_out, device="cuda", generator=g).bfloat16()
        for _ in range(args.repeat + 1):
            ops.lora_apply(y, x, A, Bt, idx, ranks, ops.lora_tiles(idx, slots))
        torch.cuda.synchronize()
        print(f"{site}: {args.repeat + 1} launches, {args.rows} rows, {args.adapters} adapters, rank {args.rank}")


if __name__ == "__main__":
    main()
