"""The two ceilings of the device (copy bandwidth, matmul rate) and the floor of a workload: the time its
decode steps and encoder pass would take at those ceilings."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_ceilings(device: str, quick: bool) -> dict:
    """Copy bandwidth (bytes read + written per second) and the matmul rate of the run dtype."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n_bytes = (1 << 30) if device == "cuda" else (64 << 20)
    a = torch.empty(n_bytes // 4, dtype=torch.float32, device=device).uniform_()
    b = torch.empty_like(a)
    m = 8192 if device == "cuda" else (512 if quick else 1024)
    x = torch.randn(m, m, device=device).to(dtype)
    y = torch.randn(m, m, device=device).to(dtype)

    def timed(fn, reps):
        fn()
        sync(device)
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        return (time.perf_counter() - t) / reps

    copy_s = timed(lambda: b.copy_(a), 10)
    mm_s = timed(lambda: x @ y, 10 if device == "cuda" else 2)
    return {"copy_bytes_per_s": 2 * n_bytes / copy_s, "matmul_flops_per_s": 2 * m ** 3 / mm_s,
            "matmul_dtype": str(dtype)}


@dataclass
class Shape:
    d: int
    enc_layers: int
    dec_layers: int
    ffn: int
    vocab: int
    heads: int

    @classmethod
    def from_config(cls, cfg: dict) -> "Shape":
        return cls(cfg["d_model"], cfg["encoder_layers"], cfg["decoder_layers"], cfg["decoder_ffn_dim"],
                   cfg["vocab_size"], cfg["decoder_attention_heads"])

    def enc_params(self) -> int:
        return self.enc_layers * (4 * self.d * self.d + 2 * self.d * self.ffn)

    def dec_params(self) -> int:  # per decode step: decoder layers (self q/k/v/o, cross q/o, ffn) + LM head
        return self.dec_layers * (6 * self.d * self.d + 2 * self.d * self.ffn) + self.vocab * self.d


def floor_seconds(shape: Shape, segments: list[tuple[int, int, int]], ceil: dict, elem: int) -> float:
    """Sum over decode steps of max(bytes / bandwidth, FLOPs / matmul rate), plus the encoder pass.
    segments: (source length, new tokens, beams) per segment, all decoded together."""
    bw, rate = ceil["copy_bytes_per_s"], ceil["matmul_flops_per_s"]
    d, L = shape.d, shape.dec_layers
    src_tokens = sum(s for s, _, _ in segments)
    enc_flops = 2 * src_tokens * (shape.enc_params() + 2 * shape.dec_layers * d * d)  # + cross K/V projections
    total = max(shape.enc_params() * elem / bw, enc_flops / rate)
    for step in range(max(n for _, n, _ in segments)):
        live = [(s, b) for s, n, b in segments if step < n]
        rows = sum(b for _, b in live)
        kv_bytes = sum(L * 2 * d * elem * (b * (step + 1) + s) for s, b in live)
        attn_flops = sum(4 * L * d * b * (step + 1 + s) for s, b in live)
        w_bytes = shape.dec_params() * elem
        total += max((w_bytes + kv_bytes) / bw, (2 * rows * shape.dec_params() + attn_flops) / rate)
    return total
