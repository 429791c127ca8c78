"""Every CUDA kernel timed at NLLB-600M sizes against its PyTorch reference, each output checked first.

    python3 -m bench.kernels [--only attention,lora,...] [--json OUT.json]      # on the GPU machine

Eager rows are CUDA events around one Python call: at small sizes they measure the wrapper and the launch
(tens of us; torch's own ops cost the same), at large sizes the kernel. "graph" rows replay the calls in a
CUDA graph, as the engine's decode step does, so they are the kernel's own time. Sections:
  norm        embed, add_layer_norm
  attention   decode (with and without appending the step's keys) / cross / encoder attention (the last against
              torch SDPA a sequence at a time),
              and the attention plans: the automatic one, one warp an item, four warps an item with split-K
              (the thresholds ops.ONE_WARP_ITEMS_PER_SM and SHORT_ONE_WARP_ITEMS_PER_SM come from these),
              and the step's self-attention through the history table (greedy rows and beams)
  selection   greedy_select, topk_logprobs, sampling_warp (cluster and one-block), apply_processors
  linear      the linear_rows GEMV (1-4 rows) and linear_mma (1-16 rows) at each column split against cuBLAS
              (ops_linear.gemv_split's and mma_split's choices), 600M's and 3.3B's shapes, the weights cycled
              through 256 MB so that each product reads its weight from HBM
  tiles       the batch rows' products as the decode step chains them (our LayerNorm, then the product; 12 links
              in a graph, cold weights): cuBLAS against the Triton tiles (kernels/linear_triton.py), whose
              `tile` rule comes from these, at 32-512 rows of 600M's shapes and 3.3B's 2048 -> 2048
  pdl         a one-row chain of 12 decoder layers in a graph, with and without programmatic launch; a chain's
              link as a grid-wide barrier in one persistent kernel against a launch a link
  lora        lora_apply's cluster and mma kernels at decode and prefill sizes (ops_lora.LORA_KERNEL's rule)
"""
from __future__ import annotations

import argparse
import itertools
import json
from functools import partial as P
from pathlib import Path
from typing import Callable

import torch

from bench.timing import cuda_time, graph_time
from kernels import linear_triton, loader, ops, ops_linear, ops_lora, ops_selection
from kernels import reference as ref
from kernels import reference_selection as ref_sel

DEV, BF = "cuda", torch.bfloat16
D_MODEL, HEADS, HEAD_DIM, CAPACITY, VOCAB = 1024, 16, 64, 256, 256206
SECTIONS = ("norm", "attention", "selection", "linear", "tiles", "pdl", "lora")


class Table:
    """Rows of (kernel, size, us, reference us, GB/s of the bytes the kernel must move)."""

    def __init__(self):
        self.rows: list[dict] = []

    def add(self, kernel: str, size: str, us: float, ref_us: float = float("nan"), nbytes: int = 0) -> None:
        gbps = nbytes / (us * 1e-6) / 1e9 if nbytes else float("nan")
        self.rows.append(dict(kernel=kernel, size=size, us=us, ref_us=ref_us, gbps=gbps))
        print(f"{kernel:<22} {size:<48} {us:>9.1f} {ref_us:>10.1f} {gbps:>8.0f}", flush=True)

    def eager(self, kernel: str, size: str, fn: Callable, ref_fn: Callable | None, nbytes: int = 0) -> None:
        self.add(kernel, size, cuda_time(fn) * 1e3, cuda_time(ref_fn) * 1e3 if ref_fn else float("nan"), nbytes)


def randn(*shape, g: torch.Generator, dtype=BF, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)


def same(out: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-2) -> None:
    """The kernel's output against the reference's (relative Frobenius error), before it is timed."""
    o, w = out.double(), want.double()
    err = float((o - w).norm() / w.norm().clamp_min(1e-30))
    if not (torch.isfinite(out).all() and err <= tol):
        raise AssertionError(f"{what}: relative error {err:.3g} against the reference")


def norm_rows(t: Table, g: torch.Generator) -> None:
    d = D_MODEL
    table, pos = randn(VOCAB, d, g=g), randn(1026, d, g=g)
    for n in (16, 1024):
        ids = torch.randint(0, VOCAB, (n,), device=DEV, generator=g)
        p = torch.randint(2, 200, (n,), device=DEV, generator=g)
        same(ops.embed(ids, p, table, pos, 32.0), ref.embed(ids, p, table, pos, 32.0), "embed")
        t.eager("embed", f"N={n}", P(ops.embed, ids, p, table, pos, 32.0), P(ref.embed, ids, p, table, pos, 32.0),
                3 * n * d * 2)
    w, b = randn(d, g=g), randn(d, g=g)
    for n in (16, 1024, 32768):
        r, x = randn(n, d, g=g), randn(n, d, g=g)
        same(ops.add_layer_norm(r, x, w, b, 1e-5)[1], ref.add_layer_norm(r, x, w, b, 1e-5)[1], "add_layer_norm")
        t.eager("add_layer_norm", f"N={n}", P(ops.add_layer_norm, r, x, w, b, 1e-5),
                P(ref.add_layer_norm, r, x, w, b, 1e-5), 4 * n * d * 2)


def self_inputs(rows: int, length: int, g: torch.Generator) -> tuple:
    """decode_attention's arguments: `rows` cache rows of CAPACITY positions, `length` of them filled."""
    caches = [randn(rows, HEADS, CAPACITY, HEAD_DIM, g=g) for _ in "kv"]
    q = randn(rows, HEADS, HEAD_DIM, g=g)
    return (q, *caches, torch.arange(rows, device=DEV), torch.full((rows,), length, device=DEV), HEAD_DIM ** -0.5)


def cross_inputs(sources: int, beams: int, src: int, g: torch.Generator, heads: int = HEADS,
                 d: int = HEAD_DIM) -> tuple:
    """cross_attention's arguments: `sources` ranges of `src` pool tokens, each read by `beams` rows."""
    pools = [randn(sources * src, heads, d, g=g) for _ in "kv"]
    starts = (torch.arange(sources, device=DEV) * src).repeat_interleave(beams)
    q = randn(sources * beams, heads, d, g=g)
    return (q, *pools, starts, torch.full_like(starts, src), d ** -0.5)


def attention_rows(t: Table, g: torch.Generator) -> None:
    H, D, T = HEADS, HEAD_DIM, CAPACITY
    for n in (16, 256, 1024):
        q, kc, vc, rows, _, scale = self_inputs(n, T, g)
        new_kv = (randn(n, H, D, g=g), randn(n, H, D, g=g))
        last = torch.full((n,), T - 1, device=DEV)
        t.eager("kv_append", f"N={n}", P(ops.kv_append, kc, vc, rows, last, *new_kv),
                P(ref.kv_append, kc, vc, rows, last, *new_kv), 4 * n * H * D * 2)
        for length in (T, T // 2):
            lengths = torch.full((n,), length, device=DEV)
            args = (q, kc, vc, rows, lengths, scale)
            same(ops.decode_attention(*args), ref.decode_attention(*args), "decode_attention")
            t.eager("decode_attention", f"N={n} len={length}", P(ops.decode_attention, *args),
                    P(ref.decode_attention, *args), 2 * n * H * length * D * 2)
        t.eager("decode_attention", f"N={n} len={T}, appending k and v", P(ops.decode_attention, *args, new_kv=new_kv),
                P(ref.decode_attention, *args, new_kv=new_kv), 2 * n * H * T * D * 2)
        del kc, vc
    for sources, beams in ((16, 1), (1024, 1), (256, 4)):
        args = cross_inputs(sources, beams, 32, g)
        same(ops.cross_attention(*args), ref.cross_attention(*args), "cross_attention")
        t.eager("cross_attention", f"N={sources * beams} src=32", P(ops.cross_attention, *args),
                P(ref.cross_attention, *args), 2 * sources * 32 * H * D * 2)
    for batch, slen in ((16, 32), (1024, 32), (64, 120)):
        cu = [i * slen for i in range(batch + 1)]
        q, k, v = (randn(cu[-1], H, D, g=g) for _ in range(3))
        same(ops.encoder_attention(q, k, v, cu, 0.125), ref.encoder_attention(q, k, v, cu, 0.125), "encoder")
        t.eager("encoder_attention", f"B={batch} S={slen} (ref us: SDPA a sequence)",
                P(ops.encoder_attention, q, k, v, cu, 0.125), P(sdpa_per_sequence, q, k, v, cu, 0.125),
                4 * cu[-1] * H * D * 2)
    attention_plans(t, g)
    history_rows(t, g)
    beam_source_rows(t, g)


def beam_source_rows(t: Table, g: torch.Generator) -> None:
    """The cross-attention of beam segments over 32 source tokens, a warp a row against a warp a segment's rows of
    a head (`group`), in a graph; heads of 64 and 128 (3.3B's)."""
    for heads, d in ((HEADS, HEAD_DIM), (16, 128)):
        for sources, beams in ((64, 4), (256, 4), (256, 2), (512, 4)):
            args = cross_inputs(sources, beams, 32, g, heads, d)
            same(ops.cross_attention(*args, max_len=32, group=beams), ref.cross_attention(*args), "cross_attention")
            for how, group in (("a warp a row", 1), ("a warp a segment's rows", beams)):
                t.add("cross-attention of beams", f"H={heads} D={d} N={sources}x{beams} src=32, {how}, graph",
                      graph_time(P(ops.cross_attention, *args, max_len=32, group=group)) * 1e3,
                      nbytes=2 * sources * 32 * heads * d * 2)


def history_rows(t: Table, g: torch.Generator) -> None:
    """The step's self-attention as the engine runs it, every key's row read through the history table: greedy
    rows (each row its own history) and beams (each position from a random row of its beam group of 4), 33 keys
    (a 64-token decode halfway), in a graph."""
    length = 33
    for n in (256, 1024):
        q, kc, vc, rows, _, scale = self_inputs(n, CAPACITY, g)
        lengths = torch.full((n,), length, device=DEV)
        own = rows.to(torch.int32)[:, None].repeat(1, CAPACITY)
        beams = (rows[:, None] // 4 * 4 + torch.randint(0, 4, (n, CAPACITY), device=DEV, generator=g)).to(torch.int32)
        beams[:, length - 1] = rows.to(torch.int32)  # a row's own current position is its own
        for what, history in (("greedy", own), ("beams", beams)):
            args = (q, kc, vc, rows, lengths, scale)
            same(ops.decode_attention(*args, history=history), ref.decode_attention(*args, history=history),
                 f"decode_attention through the {what} history")
            t.add("attention history", f"self N={n} len={length}, {what}, graph",
                  graph_time(P(ops.decode_attention, *args, history=history)) * 1e3,
                  nbytes=2 * n * HEADS * length * HEAD_DIM * 2)
        del kc, vc


def sdpa_per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float) -> torch.Tensor:
    """The alternative to encoder_attention: torch SDPA, one launch per packed sequence."""
    out = torch.empty_like(q)
    for s, e in zip(cu[:-1], cu[1:]):
        out[s:e] = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), scale=scale).transpose(0, 1)
    return out


def attention_plans(t: Table, g: torch.Generator) -> None:
    """Each decode-step attention launch in a graph under the automatic plan, one warp an item (both
    thresholds 0) and four warps an item with split-K (both out of reach); the size column names which."""
    cases = {f"cross N={n} src={s}": P(ops.cross_attention, *cross_inputs(n, 1, s, g), max_len=s)
             for n in (16, 64, 256, 512) for s in (32, 128)}
    cases.update({f"self N={n} len={ln}": P(ops.decode_attention, *self_inputs(n, ln, g))
                  for n in (1, 16, 64, 256, 512) for ln in (8, 32, 128, 250)})
    auto = ops.ONE_WARP_ITEMS_PER_SM, ops.SHORT_ONE_WARP_ITEMS_PER_SM
    try:
        for name, fn in cases.items():
            for plan, thresholds in (("auto", auto), ("one warp", (0, 0)), ("four warps", (1 << 30, 1 << 30))):
                ops.ONE_WARP_ITEMS_PER_SM, ops.SHORT_ONE_WARP_ITEMS_PER_SM = thresholds
                t.add("attention plan", f"{name}, {plan}, graph", graph_time(fn) * 1e3)
    finally:
        ops.ONE_WARP_ITEMS_PER_SM, ops.SHORT_ONE_WARP_ITEMS_PER_SM = auto


def logits(n: int, V: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    x = randn(n, V, g=g, dtype=torch.float32, scale=3.0)
    x[:, ::97] = float("-inf")  # banned tokens (processors) are -inf
    return x.to(dtype)


def selection_rows(t: Table, g: torch.Generator) -> None:
    V = VOCAB
    for n in (16, 256, 1024):
        x = logits(n, V, torch.float32, g)
        same(ops.greedy_select(x)[1], ref_sel.greedy_select(x)[1], "greedy_select", tol=1e-5)
        t.eager("greedy_select", f"N={n} fp32", P(ops.greedy_select, x), P(ref_sel.greedy_select, x), n * V * 4)
        head = logits(n, V + 8 - V % 8, BF, g)[:, :V]  # the LM head's bf16 rows, padded: 16-byte reads
        t.eager("greedy_select", f"N={n} bf16, padded rows", P(ops.greedy_select, head),
                P(ref_sel.greedy_select, head), n * V * 2)
        for k in (8, 128):
            same(ops.topk_logprobs(x, k)[0], ref_sel.topk_logprobs(x, k)[0], "topk_logprobs", tol=1e-5)
            t.eager("topk_logprobs", f"N={n} k={k} fp32", P(ops.topk_logprobs, x, k), P(ref_sel.topk_logprobs, x, k),
                    n * V * 4)
        del x
    for n in (1, 16, 64):  # sampled rows; ref us: the reference
        x = logits(n, V, torch.float32, g)
        try:
            for (k, p), clusters in itertools.product(((50, 1.0), (50, 0.9), (0, 0.9)), (None, False)):
                warp_args = (torch.ones(n, device=DEV), torch.full((n,), k, device=DEV),
                             torch.full((n,), p, device=DEV, dtype=torch.float64))
                ops_selection.SAMPLE_CLUSTERS = clusters
                t.eager("sampling_warp", f"N={n} top-k {k} top-p {p} {'auto' if clusters is None else 'one block'}",
                        P(ops.sampling_warp, x, *warp_args), P(ref_sel.sampling_warp, x, *warp_args), n * V * 4)
        finally:
            ops_selection.SAMPLE_CLUSTERS = None
        ids = torch.randint(0, 64, (n, 64), device=DEV, generator=g)
        every = torch.full((n,), 1, device=DEV)
        proc_args = (torch.arange(n, device=DEV), ids, every * 64, torch.full((n,), 1.3, device=DEV), every * 3,
                     every, 2)
        t.eager("apply_processors", f"N={n} t=64 penalty, 3-grams", P(ops.apply_processors, x, *proc_args),
                P(ref_sel.apply_processors, x, *proc_args))


def linear_rows(t: Table, g: torch.Generator) -> None:
    d = D_MODEL
    shapes = ((d, d), (d, 3 * d), (d, 4 * d), (4 * d, d),  # 600M's
              (2 * d, 2 * d), (2 * d, 6 * d), (2 * d, 8 * d), (8 * d, 2 * d))  # 3.3B's
    try:
        ops_linear.MMA_WIDE_MAX_WEIGHT = 1 << 62  # linear_mma on every weight at 9-16 rows too, timed beside cuBLAS
        for d_in, d_out in shapes:
            copies = -(-COLD_BYTES // (d_in * d_out * 2))
            weights = [randn(d_out, d_in, g=g, scale=d_in ** -0.5) for _ in range(copies)]
            bias = randn(d_out, g=g)
            for rows in (1, 2, 4, 8, 16):
                linear_kernels(t, randn(rows, d_in, g=g), weights, bias)
    finally:
        ops_linear.GEMV_KSPLIT = ops_linear.MMA_KSPLIT = ops_linear.MMA_LOADS = None
        ops_linear.MMA_MIN_ROWS, ops_linear.MMA_WIDE_MAX_WEIGHT = MMA_MIN_ROWS, MMA_WIDE_MAX_WEIGHT


def linear_kernels(t: Table, x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor) -> None:
    """The GEMV (on its rows) and linear_mma (on any) at each column split against cuBLAS, each checked first."""
    rows, d_in = x.shape
    d_out = weights[0].shape[0]
    want = ref.linear(x.float(), weights[0].float(), bias.float())
    cublas_us = cold_graph_time(torch.nn.functional.linear, x, weights, bias)
    kernels = [("linear_mma", 1, "MMA_KSPLIT")]  # (kernel, MMA_MIN_ROWS that sends these rows to it, split knob)
    if ops.gemv_takes(rows, d_in):
        kernels.insert(0, ("linear_rows", rows + 1, "GEMV_KSPLIT"))
    for kernel, min_rows, split in kernels:
        ops_linear.MMA_MIN_ROWS = min_rows
        for ksplit in (None, 1, 2, 4, 8):  # None: the one gemv_split / mma_split picks
            setattr(ops_linear, split, ksplit)
            same(ops.linear(x, weights[0], bias), want, kernel)
            t.add(kernel, f"M={rows} {d_in}->{d_out} ksplit {ksplit or 'auto'}, graph (ref: cuBLAS)",
                  cold_graph_time(ops.linear, x, weights, bias), cublas_us, d_in * d_out * 2)
        setattr(ops_linear, split, None)
        if kernel == "linear_mma":
            for loads in (4, 8):  # chunks a batch at the auto split (mma_loads picks one)
                ops_linear.MMA_LOADS = loads
                same(ops.linear(x, weights[0], bias), want, kernel)
                t.add(kernel, f"M={rows} {d_in}->{d_out} {loads} chunks a batch, graph (ref: cuBLAS)",
                      cold_graph_time(ops.linear, x, weights, bias), cublas_us, d_in * d_out * 2)
            ops_linear.MMA_LOADS = None
    ops_linear.MMA_MIN_ROWS = MMA_MIN_ROWS


TILE_PLANS = ((64, 64, 4, 4), (64, 64, 8, 4), (64, 128, 4, 4), (64, 128, 8, 4), (128, 64, 8, 4))  # BM BN warps stages


def tile_rows(t: Table, g: torch.Generator) -> None:
    """A LayerNorm then each product, 12 links in a graph, each link its own cold weight: cuBLAS against each Triton
    tile (its bits checked against cuBLAS's first), in us a link."""
    if linear_triton.triton is None:
        print("tiles: this torch has no Triton", flush=True)
        return
    d = D_MODEL
    for d_in, d_out in ((d, d), (d, 3 * d), (d, 4 * d), (4 * d, d), (2 * d, 2 * d)):
        copies = -(-COLD_BYTES // (d_in * d_out * 2))
        weights = [randn(d_out, d_in, g=g, scale=d_in ** -0.5) for _ in range(copies)]
        bias = randn(d_out, g=g)
        norm_w, norm_b = randn(d_in, g=g), randn(d_in, g=g)
        for rows in (32, 64, 128, 256, 512):
            x = randn(rows, d_in, g=g)
            cublas_us = chain_link_time(torch.nn.functional.linear, x, weights, bias, norm_w, norm_b)
            want = torch.nn.functional.linear(x, weights[0], bias)
            for plan in TILE_PLANS:
                tiled = P(linear_triton.run, relu=False, plan=plan)
                bits = torch.equal(tiled(x, weights[0], bias), want)
                t.add("linear_triton", f"M={rows} {d_in}->{d_out} {plan}{'' if bits else ' other bits'}, link",
                      chain_link_time(tiled, x, weights, bias, norm_w, norm_b), cublas_us)


def chain_link_time(op: Callable, x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor,
                    norm_w: torch.Tensor, norm_b: torch.Tensor) -> float:
    """Microseconds a link of add_layer_norm(x) then op(normed, w, bias), 12 links a call, a weight each."""
    it = itertools.cycle(weights)

    def links() -> None:
        for _ in range(12):
            op(ops.add_layer_norm(x, None, norm_w, norm_b, 1e-5)[1], next(it), bias)
    return graph_time(links, calls=max(1, len(weights) // 12), replays=20) * 1e3 / 12


MMA_MIN_ROWS, MMA_WIDE_MAX_WEIGHT = ops_linear.MMA_MIN_ROWS, ops_linear.MMA_WIDE_MAX_WEIGHT  # the rule, restored
COLD_BYTES = 256 << 20  # weights a linear timing cycles through: more than L2 holds, as a decode step's layers are


def cold_graph_time(op: Callable, x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor) -> float:
    """Microseconds per op(x, w, bias) in a graph that runs it once over each of `weights` (each read from HBM)."""
    it = itertools.cycle(weights)
    return graph_time(lambda: op(x, next(it), bias), calls=len(weights)) * 1e3


def layer_weights(d: int, g: torch.Generator) -> dict:
    """One decoder layer's self-attention and feed-forward weights (bf16), scaled to keep activations O(1)."""
    w = {name: randn(o, i, g=g, scale=i ** -0.5)
         for name, (o, i) in {"qkv": (3 * d, d), "out": (d, d), "fc1": (4 * d, d), "fc2": (d, 4 * d)}.items()}
    w |= {f"{name}_b": randn(w[name].shape[0], g=g, scale=0.1) for name in list(w)}
    w |= {f"ln{i}_{p}": randn(d, g=g, scale=0.1) + (p == "w") for i in (1, 2, 3) for p in "wb"}
    return w


def one_row_layers(x, weights, k_cache, v_cache, rows, lengths, norms: bool = True, attention: bool = True):
    """A one-row decode step's chain through `weights` (a list of layer_weights): LayerNorm, q|k|v GEMV,
    attention (appending k and v), out GEMV, add + LayerNorm, fc1 (ReLU), fc2, add + LayerNorm, per layer.
    Without `norms` the LayerNorms are left out (each GEMV reads the one before's output), without `attention`
    the out GEMV reads q: what each kind of link costs the chain.
    Shape: k_cache, v_cache [layers, R, H, T, D]"""
    H, D = k_cache.shape[2], k_cache.shape[4]
    h = ops.add_layer_norm(x, None, weights[0]["ln1_w"], weights[0]["ln1_b"], 1e-5)[1] if norms else x
    for layer, w in enumerate(weights):
        qkv = ops.linear(h, w["qkv"], w["qkv_b"]).view(1, 3, H, D)
        a = qkv[:, 0]
        if attention:
            a = ops.decode_attention(qkv[:, 0], k_cache[layer], v_cache[layer], rows, lengths, D ** -0.5,
                                     new_kv=(qkv[:, 1], qkv[:, 2]))
        o = ops.linear(a.reshape(1, H * D), w["out"], w["out_b"])
        residual, h = ops.add_layer_norm(h, o, w["ln2_w"], w["ln2_b"], 1e-5) if norms else (o, o)
        f = ops.linear(ops.linear(h, w["fc1"], w["fc1_b"], relu=True), w["fc2"], w["fc2_b"])
        h = ops.add_layer_norm(residual, f, w["ln3_w"], w["ln3_b"], 1e-5)[1] if norms else f
    return h


def pdl_rows(t: Table, g: torch.Generator) -> None:
    """12 one-row layers in a graph with programmatic launch (against without); then without their LayerNorms,
    their attention or both, so that the differences give what each kind of link costs the chain."""
    d = D_MODEL
    weights, x = [layer_weights(d, g) for _ in range(12)], randn(1, d, g=g)
    caches = [randn(12, 2, HEADS, 64, HEAD_DIM, g=g) for _ in "kv"]
    one, forty = torch.tensor([1], device=DEV), torch.tensor([40], device=DEV)
    chain = P(one_row_layers, x, weights, *caches, one, forty)
    chain_us = {}
    try:
        for pdl in (True, False):
            loader.PDL = pdl
            chain_us[pdl] = graph_time(chain, calls=1) * 1e3
    finally:
        loader.PDL = None
    t.add("12 layers (PDL)", "M=1, 40 keys, graph (ref: without PDL)", chain_us[True], chain_us[False])
    for norms, attention, what in ((False, True, "without LayerNorms"), (True, False, "without attention"),
                                   (False, False, "GEMVs alone")):
        t.add("12 layers (PDL)", f"M=1, {what}, graph", graph_time(P(chain, norms=norms, attention=attention),
                                                                   calls=1) * 1e3)
    barrier_rows(t)


def barrier_rows(t: Table) -> None:
    """A dependent chain's link as a grid-wide barrier inside one persistent kernel against a kernel launch a link
    in a graph, with and without programmatic launch (bench/grid_barrier.cu), each checked by its rounds' sums."""
    mod = loader.module_with_header((Path(__file__).parent / "grid_barrier.cu").read_text())
    rounds_kernel, link_kernel = mod.get_function("barrier_rounds"), mod.get_function("barrier_link")
    G = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.zeros(2 * G, device=DEV)
    count, flag = (torch.zeros(1, dtype=torch.int32, device=DEV) for _ in range(2))
    rounds, links = 2000, 200

    def persistent(work: int) -> None:
        for tensor in (buf, count, flag):
            tensor.zero_()
        loader.launch_kernel(rounds_kernel, (G,), (256,),
                             (*map(loader.ptr, (buf, count, flag)), loader.i32(rounds), loader.i32(work)))

    def chain(work: int) -> None:
        buf.zero_()
        for i in range(links):
            loader.launch_kernel(link_kernel, (G,), (256,),
                                 (loader.ptr(buf[(i & 1) * G:]), loader.ptr(buf[((i + 1) & 1) * G:]),
                                  loader.i32(work)))

    def checked(rounds_done: int) -> None:
        torch.cuda.synchronize()
        if not torch.equal(buf[(rounds_done & 1) * G:][:G], torch.full((G,), float(rounds_done), device=DEV)):
            raise AssertionError(f"grid barrier bench: a round read before the one before had written ({buf})")

    try:
        for work, what in ((0, "nothing"), (1, "an L2 read and a block sum")):
            persistent(work)
            if work:
                checked(rounds)
            t.add("grid barrier", f"{G} blocks, {what}: a barrier", cuda_time(P(persistent, work)) * 1e3 / rounds)
            for pdl in (True, False):
                loader.PDL = pdl
                chain(work)
                if work:
                    checked(links)
                us = graph_time(P(chain, work), calls=1) * 1e3 / links
                t.add("grid barrier", f"{G} blocks, {what}: a launch (PDL {'on' if pdl else 'off'}), graph", us)
    finally:
        loader.PDL = None


def lora_rows(t: Table, g: torch.Generator) -> None:
    """Both tensor-core kernels at the decoder's site shapes: decode rows, and a prefill of 256 x 32 tokens; 36
    slots of rank 16 (the engine's registry at the bench's 32 adapters: N // 16 + 36 tile records, most unused)."""
    d, slots, rank = D_MODEL, 36, 16
    sites = {"q|k|v": (3, d, d), "fc1": (1, d, 4 * d), "fc2": (1, 4 * d, d)}
    try:
        for (site, (parts, d_in, d_out)), (n, adapters) in itertools.product(
                sites.items(), ((1, 1), (256, 1), (256, 32), (8192, 8))):
            A = randn(slots, parts, rank, d_in, g=g, scale=0.05)
            Bt = randn(slots, parts, rank, d_out, g=g, scale=0.05)
            x, y = randn(n, d_in, g=g), randn(n, parts * d_out, g=g)
            ranks = torch.full((slots,), rank, dtype=torch.int32, device=DEV)
            idx = torch.arange(n, device=DEV) % adapters + 1  # every row adapted, adapters interleaved
            tiles = ops.lora_tiles(idx, slots)
            want = y.float()
            ref.lora_apply(want, x.float(), A.float(), Bt.float(), idx, ranks, ref.lora_tiles(idx, slots))
            for kernel in ("cluster", "mma"):  # the graph captures the switch's pick
                ops_lora.LORA_KERNEL = kernel
                out = y.clone()
                ops.lora_apply(out, x, A, Bt, idx, ranks, tiles)
                same(out, want, f"lora_apply {kernel}")
                us = graph_time(P(ops.lora_apply, out, x, A, Bt, idx, ranks, tiles)) * 1e3
                t.add(f"lora {kernel} {site} r16", f"N={n}, {adapters} adapters, graph", us)
    finally:
        ops_lora.LORA_KERNEL = "auto"


def main() -> None:
    ap = argparse.ArgumentParser(prog="python3 -m bench.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    sections = args.only.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    g = torch.Generator(DEV).manual_seed(53)
    table = Table()
    print(f"{'kernel':<22} {'size':<48} {'us':>9} {'ref us':>10} {'GB/s':>8}", flush=True)
    runs = {"norm": norm_rows, "attention": attention_rows, "selection": selection_rows, "linear": linear_rows,
            "tiles": tile_rows, "pdl": pdl_rows, "lora": lora_rows}
    for name in sections:
        runs[name](table, g)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table.rows, f, indent=1)


if __name__ == "__main__":
    main()
