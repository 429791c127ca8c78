"""NLLB-200 (HF M2M100) encoder and decoder forward over packed tokens and the slot table.

Pre-LayerNorm transformer, ReLU FFN, token embeddings x sqrt(d_model), sinusoidal positions
(sin half then cos half; positions start at padding_idx + 1 = 2), a final LayerNorm after each
stack, LM head tied to the embedding. The hot operations go through `ops` (kernels/reference.py
on the CPU, the CUDA kernels on the GPU), so this file is the same on both paths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch

from engine.config import ModelConfig
from engine.weights import EncoderLayer, Linear, Weights
from kernels.site_lora import SiteLora

POSITION_OFFSET = 2  # HF M2M100SinusoidalPositionalEmbedding.offset: positions start at pad + 1


def sinusoidal_table(num_positions: int, dim: int, padding_idx: int) -> torch.Tensor:
    """HF's table: row p = [sin(p * f_i), cos(p * f_i)], f_i = 10000^(-i / (dim/2 - 1)); pad row 0."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.int64).float() * -(math.log(10000) / (half - 1)))
    angles = torch.arange(num_positions, dtype=torch.int64).float()[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num_positions, 1)], dim=1)
    table[padding_idx] = 0
    return table


@dataclass
class LoraBatch:
    """The adapters of one forward call (see engine/lora.py for the stack layout)."""

    A: dict  # prefill site, or decoder step site shrunk in its LayerNorm (cross q, fc1) -> [S, P, R, in] stacks
    W_ext: dict  # decoder step site -> [P*out + P*S*R, in]: the projection's weight, then every slot's A; for
    # cross q and fc1 [out, in + S*R]: the weight, then every slot's B (columns)
    b_ext: dict  # decoder step site -> [P*out + P*S*R] the bias, then zeros (None: no bias); cross q, fc1: the bias
    Bt: dict  # site -> [S, P, R, out]
    ranks: dict  # site -> [S] int32, each slot's rank at the site (0: not adapted there)
    idx: torch.Tensor  # [N] int64 adapter slot of each token or row (0: none)
    tiles: torch.Tensor | None  # [N // 16 + S, 32] int32 the adapted rows in tiles of one slot (ops.lora_tiles), the
    # prefill's sites' (None in a decode step: its sites expand each row's delta from its own h)
    sites: set  # the sites to apply (any other site is skipped without a launch)


def adapts(lora: LoraBatch | None, site: tuple) -> bool:
    """Whether a forward call's adapters (None: none) apply at `site`."""
    return lora is not None and site in lora.sites


class NllbModel:
    """Stateless forward functions over weights; caches live in the slot table (engine/slots.py)."""

    def __init__(self, cfg: ModelConfig, weights: Weights, ops: ModuleType):
        self.cfg = cfg
        self.w = weights
        self.ops = ops
        self.heads = cfg.decoder_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim ** -0.5
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.pos_table = sinusoidal_table(cfg.max_position_embeddings + POSITION_OFFSET, cfg.d_model,
                                          cfg.pad_token_id).to(weights.embed)

    def _proj(self, x: torch.Tensor, layer: Linear, site: tuple, lora: LoraBatch | None,
              relu: bool = False) -> torch.Tensor:
        """The prefill's projection (encoder, cross k|v) plus, for tokens whose adapter adapts `site`, its
        LoRA delta over tiles (lora_apply); then ReLU when asked (fused into the projection when no LoRA comes
        between). The decoder step's projections: _step_proj_shrunk, _step_proj_apart."""
        adapted = adapts(lora, site)
        y = self.ops.linear(x, layer.weight, layer.bias, relu and not adapted)
        if adapted:
            self.ops.lora_apply(y, x, lora.A[site], lora.Bt[site], lora.idx, lora.ranks[site], lora.tiles)
            if relu:
                y = torch.relu_(y)
        return y

    @staticmethod
    def _shrink(site: tuple, lora: LoraBatch | None) -> SiteLora | None:
        """add_layer_norm's shrink for the projection at `site` that reads its output (cross q, fc1): the site's
        A stacks, the rows' slots and ranks; None where no adapter of the batch adapts it."""
        return SiteLora(lora.A[site], lora.idx, lora.ranks[site]) if adapts(lora, site) else None

    def _step_proj_shrunk(self, x: torch.Tensor, layer: Linear, site: tuple, lora: LoraBatch | None,
                          relu: bool = False) -> torch.Tensor:
        """The decoder step's projection of a LayerNorm's output, which carries each row's LoRA h where an
        adapter of the batch adapts `site` (add_layer_norm's shrink): one GEMM over the weight with every slot's
        B after its columns adds the delta, then the bias and ReLU when asked."""
        return self.ops.linear(x, lora.W_ext[site] if adapts(lora, site) else layer.weight, layer.bias, relu)

    def _step_proj_apart(self, x: torch.Tensor, layer: Linear, site: tuple, lora: LoraBatch | None
                         ) -> tuple[torch.Tensor, SiteLora | None]:
        """The decoder step's projection for an op that adds the LoRA delta as it reads it (add_layer_norm,
        kv_append_lora): y and None, or, where an adapter of the batch adapts `site`, y with every
        slot's h after it and the delta (Bt stacks, slots, ranks) with which the op adds each row's delta."""
        if not adapts(lora, site):
            return self.ops.linear(x, layer.weight, layer.bias), None
        return (self.ops.linear(x, lora.W_ext[site], lora.b_ext[site]),
                SiteLora(lora.Bt[site], lora.idx, lora.ranks[site]))

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.heads, self.head_dim)  # [N, d] -> [N, H, D]

    def _ffn(self, layer: EncoderLayer, x: torch.Tensor, stack: str, i: int, lora: LoraBatch | None) -> torch.Tensor:
        hidden = self._proj(x, layer.fc1, (stack, i, "fc1"), lora, relu=True)
        return self._proj(hidden, layer.fc2, (stack, i, "fc2"), lora)

    # ---- encoder -------------------------------------------------------------------------
    def encode(self, ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
               lora: LoraBatch | None = None) -> torch.Tensor:
        """Encode packed sources; nothing is read on the host (a CUDA graph can hold it).
        Shape: ids, positions [N] int64 (sequences back to back; positions 0-based within each
        sequence); cu_seqlens [B + 1] int64 offsets on ids' device; max_len >= every sequence's
        length (plans attention); out [N, d]."""
        d = self.cfg.d_model
        h = self.ops.embed(ids, positions + POSITION_OFFSET, self.w.embed, self.pos_table, self.embed_scale)
        x = None
        for i, layer in enumerate(self.w.encoder):
            h, normed = self.ops.add_layer_norm(h, x, *layer.attn_norm, self.cfg.layer_norm_eps)
            q, k, v = self._proj(normed, layer.qkv, ("encoder", i, "qkv"), lora).split(d, dim=-1)
            attn = self.ops.encoder_attention(self._split_heads(q), self._split_heads(k),
                                              self._split_heads(v), cu_seqlens, self.scale, max_len)
            attn = self._proj(attn.reshape(-1, d), layer.out, ("encoder", i, "out"), lora)
            h, normed = self.ops.add_layer_norm(h, attn, *layer.ffn_norm, self.cfg.layer_norm_eps)
            x = self._ffn(layer, normed, "encoder", i, lora)
        return self.ops.add_layer_norm(h, x, *self.w.encoder_norm, self.cfg.layer_norm_eps)[1]

    def cross_kv(self, i: int, enc_out: torch.Tensor, lora: LoraBatch | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer i's cross-attention keys and values. Shape: enc_out [N, d]; k, v [N, H, D]."""
        layer = self.w.decoder[i]
        k, v = self._proj(enc_out, layer.cross_kv, ("decoder", i, "cross_kv"), lora).split(self.cfg.d_model, dim=-1)
        return self._split_heads(k), self._split_heads(v)

    # ---- decoder -------------------------------------------------------------------------
    def decode_step(self, tokens: torch.Tensor, steps: torch.Tensor, rows: torch.Tensor,
                    src_starts: torch.Tensor, src_lens: torch.Tensor,
                    self_k: torch.Tensor, self_v: torch.Tensor, history: torch.Tensor,
                    cross_k: torch.Tensor, cross_v: torch.Tensor, lora: LoraBatch | None = None,
                    src_len_bound: int | None = None, self_len_bound: int | None = None,
                    rows_per_source: int = 1) -> torch.Tensor:
        """One decoder step for N rows, each at its own step, appending its self-attention KV.
        Shape: tokens, steps, rows, src_starts, src_lens [N] int64 (steps: 0-based target index);
        self_k, self_v [L, R, H, T, D]; history [R, T] int32 (which row holds each position of a
        row's hypothesis); cross_k, cross_v [L, P, H, D]; out hidden [N, d].
        src_len_bound, self_len_bound: host bounds of src_lens and of steps + 1 (let the kernels plan without
        reading lengths; without self_len_bound the cache's capacity T); rows_per_source: runs of that many
        consecutive rows share src_starts and src_lens (a beam segment's rows; a graph's filler rows past them
        are all alike), which the cross-attention may load once a run (ops.cross_attention's `group`)."""
        d, eps = self.cfg.d_model, self.cfg.layer_norm_eps
        h = self.ops.embed(tokens, steps + POSITION_OFFSET, self.w.embed, self.pos_table, self.embed_scale)
        lengths = steps + 1
        x, x_lora = None, None  # the FFN's output (and its LoRA delta) for the next residual add
        for i, layer in enumerate(self.w.decoder):
            h, normed = self.ops.add_layer_norm(h, x, *layer.attn_norm, eps, delta=x_lora)
            qkv, qkv_lora = self._step_proj_apart(normed, layer.qkv, ("decoder", i, "qkv"), lora)
            if qkv_lora is not None:  # the LoRA delta added where k and v are appended
                qkv = self.ops.kv_append_lora(self_k[i], self_v[i], rows, steps, qkv, qkv_lora)
                q, new_kv = self._split_heads(qkv[:, :d]), None
            else:  # k and v appended by the attention (position steps = lengths - 1)
                q, k, v = (self._split_heads(t) for t in qkv.split(d, dim=-1))
                new_kv = (k, v)
            attn = self.ops.decode_attention(q, self_k[i], self_v[i], rows, lengths, self.scale, history=history,
                                             new_kv=new_kv, max_len=self_len_bound)
            attn, attn_lora = self._step_proj_apart(attn.reshape(-1, d), layer.out, ("decoder", i, "out"), lora)
            site = ("decoder", i, "cross_q")
            h, normed = self.ops.add_layer_norm(h, attn, *layer.cross_norm, eps, delta=attn_lora,
                                                shrink=self._shrink(site, lora))
            q = self._step_proj_shrunk(normed, layer.cross_q, site, lora)
            attn = self.ops.cross_attention(self._split_heads(q), cross_k[i], cross_v[i], src_starts, src_lens,
                                            self.scale, max_len=src_len_bound, group=rows_per_source)
            attn, attn_lora = self._step_proj_apart(attn.reshape(-1, d), layer.cross_out,
                                                      ("decoder", i, "cross_out"), lora)
            site = ("decoder", i, "fc1")
            h, normed = self.ops.add_layer_norm(h, attn, *layer.ffn_norm, eps, delta=attn_lora,
                                                shrink=self._shrink(site, lora))
            hidden = self._step_proj_shrunk(normed, layer.fc1, site, lora, relu=True)
            x, x_lora = self._step_proj_apart(hidden, layer.fc2, ("decoder", i, "fc2"), lora)
        return self.ops.add_layer_norm(h, x, *self.w.decoder_norm, eps, delta=x_lora)[1]

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Shape: hidden [N, d]; returns [N, V] in the model dtype, a view with the padded head's row stride.
        Selection reads them as float32, which is what HF does with the same bf16 logits; an fp32 copy
        here would cost 4 bytes x N x V a step.
        Shape: out [N, V'] (the padded head's rows) to write the product into, on the GPU; None: a new one."""
        head = self.w.lm_head
        # on the CPU through the reference's linear (oneDNN's float32 product; MKL's faster few-row layout without it)
        logits = torch.mm(hidden, head.t(), out=out) if hidden.is_cuda else self.ops.linear(hidden, head, None)
        return logits[:, :self.cfg.vocab_size]

    def logits_buffer(self, n: int) -> torch.Tensor:
        """An empty [n, V'] product of the padded head for `logits(..., out=)`."""
        head = self.w.lm_head
        return torch.empty(n, head.shape[0], dtype=head.dtype, device=head.device)
