"""Which CUDA ops can run a model of given shapes: the shape checks the wrappers in kernels/ops*.py make on every
call, made once at load from the model's shapes alone (no torch, CuPy or GPU needed). engine/devices.py
(Backend.for_model) runs the PyTorch reference for each op named here, so a checkpoint the kernels cannot serve
runs slower instead of failing every job, and refuses the shapes that no path runs.

Shapes the ops see: rows of d_model (embeddings, LayerNorms, q|k|v and the other projections, KV caches of H
heads of D = d_model / H), rows of each stack's ffn dim (fc1's output, fc2's input) and rows of V logits. The
wrappers' other checks concern dtypes, strides and alignment, which the engine's own tensors meet; the LoRA ranks
and slot counts are the adapter registry's (engine/lora.py keeps ranks within LORA_MAX_RANK).
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.limits import BEAM_MAX, BLOCK_THREADS_MAX, HEAD_DIMS, INT32_MAX, LN_MAX_D, LORA_OPT, VEC

CACHE_AND_ATTENTION_OPS = ("kv_append", "kv_append_lora", "decode_attention", "cross_attention", "encoder_attention")
VOCAB_OPS = ("greedy_select", "topk_logprobs", "apply_processors", "sampling_warp", "sample_draw")


@dataclass(frozen=True)
class ModelShapes:
    d_model: int
    heads: int
    ffn_dims: tuple[int, ...]  # the encoder's and the decoder's
    vocab: int

    @classmethod
    def of(cls, cfg) -> "ModelShapes":
        """The shapes of an engine.config.ModelConfig (or anything with its fields)."""
        return cls(cfg.d_model, cfg.decoder_heads, (cfg.encoder_ffn_dim, cfg.decoder_ffn_dim), cfg.vocab_size)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


def unsupported_ops(shapes: ModelShapes) -> dict[str, str]:
    """op name (kernels.reference's) -> why its CUDA kernel cannot run these shapes; empty when all can."""
    reasons: dict[str, list[str]] = {}

    def cannot(ops: tuple[str, ...], why: str) -> None:
        for op in ops:
            reasons.setdefault(op, []).append(why)

    d, head_dim = shapes.d_model, shapes.head_dim
    if head_dim not in HEAD_DIMS:
        cannot(CACHE_AND_ATTENTION_OPS, f"head dim {head_dim} (d_model {d} / {shapes.heads} heads); the attention "
                                        f"and KV cache kernels take {', '.join(map(str, HEAD_DIMS))}")
    if d % VEC or d > LN_MAX_D:
        cannot(("add_layer_norm",), f"d_model {d}; the LayerNorm kernel takes a multiple of {VEC} up to {LN_MAX_D}")
    if d % VEC or d // VEC > BLOCK_THREADS_MAX:
        cannot(("kv_append_lora",), f"d_model {d}; the LoRA q|k|v kernel takes a multiple of {VEC} up to "
                                    f"{VEC * BLOCK_THREADS_MAX}")
    widths = sorted({d, *shapes.ffn_dims})  # lora_apply's inputs and outputs: d, or ffn (fc1's out, fc2's in)
    if any(w % VEC or w % LORA_OPT for w in widths):
        cannot(("lora_apply",), f"d_model {d}, ffn dims {list(shapes.ffn_dims)}; the gathered LoRA kernel takes "
                                f"inputs of a multiple of {VEC} and outputs of a multiple of {LORA_OPT}")
    if shapes.vocab > INT32_MAX:
        cannot(VOCAB_OPS, f"vocab_size {shapes.vocab}; the selection kernels index up to {INT32_MAX}")
    return {op: "; ".join(why) for op, why in reasons.items()}


def unrunnable(shapes: ModelShapes) -> list[str]:
    """Why no path, the kernels' or the PyTorch reference's, runs these shapes (empty: one does)."""
    refusals = []
    if shapes.vocab < 2 * BEAM_MAX:  # topk_logprobs' k, in torch.topk as in the kernel
        refusals.append(f"vocab_size {shapes.vocab}: beam search ranks the 2 x num_beams best tokens of each step, "
                        f"up to {2 * BEAM_MAX} (num_beams up to {BEAM_MAX}); a vocabulary this small does not hold "
                        "them")
    return refusals
