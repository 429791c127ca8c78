"""Probe: the decoder step's attention launches timed in CUDA graphs (bf16, H 16, D 64), cross- and
self-attention, under three plans: the automatic one, one warp an item (both thresholds 0) and four warps an
item with the split-K plan (both out of reach). bench/NOTES.md (stop 15) has the numbers.

    python3 -m bench.attn_probe      # on the GPU machine; one line a case: microseconds a launch
"""
from __future__ import annotations

import torch

from kernels import ops
from tests.kernels.test_kernels import graph_time

H, D, CAPACITY = 16, 64, 256


def cross_case(rows: int, src: int, g: torch.Generator):
    """A launch of cross_attention over `rows` rows of `src` source tokens."""
    dev, bf = "cuda", torch.bfloat16
    k_pool = torch.randn(rows * src, H, D, device=dev, generator=g).to(bf)
    v_pool = torch.randn(rows * src, H, D, device=dev, generator=g).to(bf)
    starts = torch.arange(rows, device=dev) * src
    lengths = torch.full((rows,), src, device=dev)
    q = torch.randn(rows, H, D, device=dev, generator=g).to(bf)
    return lambda: ops.cross_attention(q, k_pool, v_pool, starts, lengths, D ** -0.5, max_len=src)


def self_case(rows: int, length: int, g: torch.Generator):
    """A launch of decode_attention over `rows` cache rows of CAPACITY positions, `length` of them filled."""
    dev, bf = "cuda", torch.bfloat16
    k_cache = torch.randn(rows, H, CAPACITY, D, device=dev, generator=g).to(bf)
    v_cache = torch.randn(rows, H, CAPACITY, D, device=dev, generator=g).to(bf)
    q = torch.randn(rows, H, D, device=dev, generator=g).to(bf)
    return lambda: ops.decode_attention(q, k_cache, v_cache, torch.arange(rows, device=dev),
                                        torch.full((rows,), length, device=dev), D ** -0.5)


def main() -> None:
    g = torch.Generator("cuda").manual_seed(0)
    cases = {f"cross N={n} src={s}": cross_case(n, s, g) for n in (16, 64, 128, 256, 512) for s in (32, 128)}
    cases.update({f"self N={n} len={t}": self_case(n, t, g) for n in (1, 16, 64, 128, 256, 512)
                  for t in (8, 32, 128, 250)})
    auto = ops.ONE_WARP_ITEMS_PER_SM, ops.SHORT_ONE_WARP_ITEMS_PER_SM
    for name, fn in cases.items():
        times = []
        for thresholds in (auto, (0, 0), (1 << 30, 1 << 30)):
            ops.ONE_WARP_ITEMS_PER_SM, ops.SHORT_ONE_WARP_ITEMS_PER_SM = thresholds
            times.append(graph_time(fn) * 1e3)
        ops.ONE_WARP_ITEMS_PER_SM, ops.SHORT_ONE_WARP_ITEMS_PER_SM = auto
        print(f"{name:34s} auto {times[0]:6.1f}  one warp {times[1]:6.1f}  four warps {times[2]:6.1f} us", flush=True)


if __name__ == "__main__":
    main()
