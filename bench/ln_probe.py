"""Probe: the decoder step's LoRA sites as the step runs them, a cuBLAS GEMM then the op that reads it, each pair
timed in a CUDA graph (bf16, 256 rows, d 1024, 36 slots of rank 16, every row adapted, row i on slot i % 32 + 1).
Taking differences places the LoRA cost: the wider GEMM, the LayerNorm's delta, its shrink, kv_append's delta,
and the K-extended GEMM over the first slots' B columns only (AdapterRegistry.slot_bound). bench/NOTES.md has
the numbers.

    python3 -m bench.ln_probe      # on the GPU machine; one line a case: microseconds a pair
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.lora import aligned_slots
from kernels import ops
from tests.kernels.test_kernels import graph_time

N, D, FFN, H, HD, R, T_CAP = 256, 1024, 4096, 16, 64, 16, 256
ADAPTERS = 32  # in slots 1..32
SLOTS, TIGHT = aligned_slots(ADAPTERS + 1, R), aligned_slots(1 + ADAPTERS // 4, R)  # the engine's: 36, 12
EXT = SLOTS * R  # a part's stacked rows or columns


def main() -> None:
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(dev).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(bf)

    idx = torch.arange(N, device=dev) % ADAPTERS + 1
    ranks = torch.full((SLOTS,), R, dtype=torch.int32, device=dev)
    x, residual = randn(N, D), randn(N, D)
    w_ln, b_ln = randn(D), randn(D)
    w = randn(D + SLOTS * R, D, scale=D ** -0.5)  # out's weight, then every slot's A rows
    bt, a_next = randn(SLOTS, 1, R, D, scale=0.05), randn(SLOTS, 1, R, D, scale=D ** -0.5)
    w_qkv = randn(3 * D + 3 * SLOTS * R, D, scale=D ** -0.5)
    bt_qkv = randn(SLOTS, 3, R, D, scale=0.05)
    k_cache, v_cache = randn(N, H, T_CAP, HD), randn(N, H, T_CAP, HD)
    rows, steps = torch.arange(N, device=dev), torch.full((N,), 7, device=dev)
    w1 = randn(FFN, D + SLOTS * R, scale=D ** -0.5)  # fc1's weight, then every slot's B columns
    normed_ext = randn(N, D + SLOTS * R)
    normed_plain, w1_plain = normed_ext[:, :D].contiguous(), w1[:, :D].contiguous()

    def ln(y, delta=(), shrink=None):
        return ops.add_layer_norm(residual, y, w_ln, b_ln, 1e-5, *delta, shrink=shrink)

    cases = {
        "gemm 1024": lambda: F.linear(x, w[:D]),
        f"gemm 1024+{EXT}": lambda: F.linear(x, w),
        "gemm 1024 -> LN": lambda: ln(F.linear(x, w[:D])),
        "gemm 1024 -> LN shrink": lambda: ln(F.linear(x, w[:D]), shrink=(a_next, idx, ranks)),
        f"gemm 1024+{EXT} -> LN delta": lambda: ln(F.linear(x, w), (bt, idx, ranks)),
        f"gemm 1024+{EXT} -> LN delta+shrink": lambda: ln(F.linear(x, w), (bt, idx, ranks), (a_next, idx, ranks)),
        "gemm qkv": lambda: F.linear(x, w_qkv[:3 * D]),
        f"gemm qkv+{3 * EXT}": lambda: F.linear(x, w_qkv),
        "gemm qkv -> kv_append": lambda: ops.kv_append(
            k_cache, v_cache, rows, steps, *(t.view(N, H, HD) for t in F.linear(x, w_qkv[:3 * D])[:, D:].split(D, 1))),
        f"gemm qkv+{3 * EXT} -> kv_append_lora": lambda: ops.kv_append_lora(
            k_cache, v_cache, rows, steps, F.linear(x, w_qkv), bt_qkv, idx, ranks),
    }
    for k in (TIGHT, SLOTS):  # fc1 over its weight and the first k slots' B columns (the two slot bounds)
        width = D + k * R
        cases[f"fc1 gemm, first {k} slots"] = lambda width=width: F.linear(normed_ext[:, :width], w1[:, :width])
    cases["fc1 gemm, no slots"] = lambda: F.linear(normed_plain, w1_plain)
    cases["fc1 gemm, no slots, weight a view"] = lambda: F.linear(normed_plain, w1[:, :D])  # the base step's
    try:
        cases.update(prefill_cases(randn))
    except Exception as exc:  # torch._grouped_mm is private: say what failed and time the rest
        print(f"prefill cases failed: {type(exc).__name__}: {exc}"[:400], flush=True)
    for name, fn in cases.items():
        try:
            print(f"{name:40s} {graph_time(fn) * 1e3:7.2f} us", flush=True)
        except Exception as exc:  # a probe of an API that may be missing: say so and go on
            print(f"{name:40s} failed: {type(exc).__name__}: {exc}"[:400], flush=True)


def prefill_cases(randn) -> dict:
    """The prefill's q|k|v site at 8192 tokens of 32 adapters, tokens ordered by slot (256 each): the GEMM and
    lora_apply (as the engine runs it), against the delta by two grouped GEMMs (torch._grouped_mm, slot-sorted
    tokens) added by cuBLAS's beta = 1 (addmm)."""
    dev, tokens, parts = "cuda", 8192, 3
    x, w = randn(tokens, D), randn(parts * D, D, scale=D ** -0.5)
    A, bt = randn(SLOTS, parts, R, D, scale=D ** -0.5), randn(SLOTS, parts, R, D, scale=0.05)
    idx = torch.arange(tokens, device=dev) // (tokens // ADAPTERS) + 1
    ranks = torch.full((SLOTS,), R, dtype=torch.int32, device=dev)
    tiles = ops.lora_tiles(idx, SLOTS)
    offs = torch.bincount(idx, minlength=SLOTS).cumsum(0).to(torch.int32)  # group g: slot g's tokens
    a_kn = A.view(SLOTS, parts * R, D).transpose(1, 2)  # [S, K=D, N=P*R], column-major
    b_diag = torch.zeros(SLOTS, parts * R, parts * D, device=dev, dtype=x.dtype)  # block-diagonal Bt
    for p in range(parts):
        b_diag[:, p * R:(p + 1) * R, p * D:(p + 1) * D] = bt[:, p]
    b_kn = b_diag.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, column-major

    def engine_path():
        y = F.linear(x, w)
        ops.lora_apply(y, x, A, bt, idx, ranks, tiles)
        return y

    def grouped_path():
        h = torch._grouped_mm(x, a_kn, offs)
        return torch.addmm(torch._grouped_mm(h, b_kn, offs), x, w.t())

    torch.testing.assert_close(grouped_path().float(), engine_path().float(), atol=0.05, rtol=0.02)
    return {"prefill qkv gemm": lambda: F.linear(x, w), "prefill qkv gemm + lora_apply": engine_path,
            "prefill qkv grouped shrink": lambda: torch._grouped_mm(x, a_kn, offs),
            "prefill qkv grouped (2 grouped + addmm)": grouped_path}


if __name__ == "__main__":
    main()
