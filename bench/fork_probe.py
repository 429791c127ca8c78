"""Probe: a decode step's 72 LoRA sites timed four ways in one CUDA graph each (256 rows, bf16, rank 16, 33
slots), every site a GEMM whose output a residual add + LayerNorm reads (bench/NOTES.md, stop 14).

    python3 -m bench.fork_probe [--timeline]     # on the GPU machine

base: GEMM -> LN(res + y), no adapter.
seq: GEMM -> lora_apply(y) -> LN(res + y): the decoder step up to stop 13 (the prefill's way still).
fork: GEMM on the main stream, lora_apply into a delta D on a side stream, joined -> LN(y + D).
concat: the decoder step now: one GEMM over W stacked on every slot's A gives y and h, and add_layer_norm
  expands each row's delta from its own h (q|k|v: lora_expand, then LN).
--timeline: the kernels of a few sites of one replay (start, end, length), for seq and concat.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from engine.graphs import capture
from kernels import ops
from tests.kernels.test_kernels import cuda_time

D_MODEL, ROWS, RANK, SLOTS = 1024, 256, 16, 33
SITES = [(3, D_MODEL, D_MODEL), (1, D_MODEL, D_MODEL), (1, D_MODEL, D_MODEL), (1, D_MODEL, D_MODEL),
         (1, D_MODEL, 4 * D_MODEL), (1, 4 * D_MODEL, D_MODEL)]  # qkv, out, cross_q, cross_out, fc1, fc2


def site_tensors(parts: int, d_in: int, d_out: int, adapters: int, g: torch.Generator) -> dict:
    dev, bf = "cuda", torch.bfloat16
    idx = torch.arange(ROWS, device=dev) % adapters + 1
    t = dict(
        x=torch.randn(ROWS, d_in, device=dev, generator=g).to(bf),
        W=(torch.randn(parts * d_out, d_in, device=dev, generator=g) * d_in ** -0.5).to(bf),
        A=(torch.randn(SLOTS, parts, RANK, d_in, device=dev, generator=g) * d_in ** -0.5).to(bf),
        Bt=(torch.randn(SLOTS, parts, RANK, d_out, device=dev, generator=g) * 1e-3).to(bf),
        D=torch.zeros(ROWS, parts * d_out, device=dev, dtype=bf),
        res=torch.randn(ROWS, parts * d_out, device=dev, generator=g).to(bf),
        w=torch.ones(parts * d_out, device=dev, dtype=bf), b=torch.zeros(parts * d_out, device=dev, dtype=bf),
        idx=idx, ranks=torch.full((SLOTS,), RANK, dtype=torch.int32, device=dev),
        tiles=ops.lora_tiles(idx, SLOTS))
    t["W_ext"] = torch.cat([t["W"], t["A"].transpose(0, 1).reshape(parts * SLOTS * RANK, d_in)])  # W over P S R
    return t


def lora(t: dict, out: torch.Tensor) -> None:
    ops.lora_apply(out, t["x"], t["A"], t["Bt"], t["idx"], t["ranks"], t["tiles"])


def site_base(t: dict) -> None:
    y = F.linear(t["x"], t["W"])
    ops.add_layer_norm(t["res"], y, t["w"], t["b"], 1e-5)


def site_seq(t: dict) -> None:
    y = F.linear(t["x"], t["W"])
    lora(t, y)
    ops.add_layer_norm(t["res"], y, t["w"], t["b"], 1e-5)


SIDE: list[torch.cuda.Stream] = []


def site_fork(t: dict) -> None:
    main, side = torch.cuda.current_stream(), SIDE[0]
    side.wait_stream(main)
    y = F.linear(t["x"], t["W"])
    with torch.cuda.stream(side):
        lora(t, t["D"])
    main.wait_stream(side)
    ops.add_layer_norm(y, t["D"], t["w"], t["b"], 1e-5)


def site_concat(t: dict) -> torch.Tensor:
    y_ext = F.linear(t["x"], t["W_ext"])  # [N, P*O + P*S*R]: y, then every slot's h
    parts = t["Bt"].shape[1]
    if parts == 1:
        return ops.add_layer_norm(t["res"], y_ext, t["w"], t["b"], 1e-5, t["Bt"], t["idx"], t["ranks"])[1]
    y = ops.lora_expand(y_ext, t["Bt"], t["idx"], t["ranks"])
    return ops.add_layer_norm(t["res"], y, t["w"], t["b"], 1e-5)[1]


def concat_error(t: dict) -> float:
    """Largest |difference| of concat's normed output from lora_apply then add_layer_norm (the prefill's way)."""
    y = F.linear(t["x"], t["W"])
    lora(t, y)
    want = ops.add_layer_norm(t["res"], y, t["w"], t["b"], 1e-5)[1]
    return float((site_concat(t).float() - want.float()).abs().max())


VARIANTS = {"base": site_base, "seq": site_seq, "fork": site_fork, "concat": site_concat}


def timeline(graph: torch.cuda.CUDAGraph, first: int, count: int) -> None:
    """Kernel start, end and length (us from the replay's first kernel) for kernels first..first+count."""
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    t0 = min(e.time_range.start for e in events)
    for e in sorted(events, key=lambda e: e.time_range.start)[first:first + count]:
        start, end = e.time_range.start - t0, e.time_range.end - t0
        print(f"  {start:8.1f} {end:8.1f} {end - start:6.1f}  {e.name[:40]}")


def main() -> None:
    SIDE.append(torch.cuda.Stream())
    g = torch.Generator(device="cuda").manual_seed(0)
    for adapters in (1, 32):
        step = [site_tensors(*s, adapters, g) for _ in range(12) for s in SITES]
        for t in step[:6]:
            t["Bt"].mul_(1000)  # a delta as large as y's own values for the check (timing does not care)
        print(f"adapters={adapters} concat vs lora_apply + add_layer_norm, max |diff| per site:",
              [round(concat_error(t), 3) for t in step[:6]], flush=True)
        for name, fn in VARIANTS.items():
            graph, _ = capture(lambda: [fn(t) for t in step], None)
            ms = cuda_time(graph.replay, warmup=3, iters=30)
            print(f"adapters={adapters} {name}: {ms * 1e3:.0f} us a step of 72 sites", flush=True)
            if "--timeline" in sys.argv and adapters == 1 and name in ("seq", "concat"):
                timeline(graph, 12, 18)


if __name__ == "__main__":
    main()
