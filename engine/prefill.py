"""The prefill: admitted segments' sources through the encoder, each decoder layer's cross K and V into
the slot table's source pool.

Sources are packed back to back (step_inputs.prefill_inputs). A pack of up to PREFILL_GRAPH_TOKENS runs
as one CUDA graph replay of its token bucket (engine/graphs.py EncoderGraphs: eager, a short source's
encoder pass is ~5 ms of Python and launches); larger packs, and the CPU, run the same function eagerly.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.devices import Backend, upload
from engine.graphs import EncoderGraphs
from engine.lora import AdapterRegistry
from engine.model import NllbModel
from engine.slots import SlotTable
from engine.step_inputs import POOL_TOKEN, SRC_ADAPTER, SRC_ID, SRC_POSITION

# the largest prefill run as a CUDA graph (~0.5 GB of activations at NLLB-600M): 256 sentences of 32 tokens
# admitted at once fit; larger packs run eagerly, where the GPU work dwarfs the launches
PREFILL_GRAPH_TOKENS = 16384


class Prefill:
    def __init__(self, model: NllbModel, table: SlotTable, adapters: AdapterRegistry | None, backend: Backend):
        self.model, self.table, self.adapters, self.backend = model, table, adapters, backend
        self.graphs = None
        if backend.capturable:
            self.graphs = EncoderGraphs(self.encode_into_pool, min(PREFILL_GRAPH_TOKENS, table.source_tokens),
                                        [model.cfg.pad_token_id, 0, table.scratch_token, 0], backend.device)

    def run(self, tokens: np.ndarray, cu_seqlens: np.ndarray, src_bound: int, slots: set[int]) -> None:
        """Encode a pack (step_inputs.prefill_inputs) whose sources are at most src_bound tokens long and
        use the adapter slots `slots` (0 left out) into the pool."""
        if self.graphs is not None:  # a graph applies LoRA wherever installed adapters do (data decides)
            sites = self.adapters.installed_sites if slots else frozenset()
            if self.graphs.run(tokens, cu_seqlens, src_bound, sites):
                return
        sites = self.adapters.active_sites(slots) if slots else frozenset()
        device = self.backend.device
        self.encode_into_pool(upload(tokens, device), upload(cu_seqlens, device), src_bound, sites)

    def encode_into_pool(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, src_bound: int,
                         sites: frozenset) -> None:
        """The prefill proper, on the device only (what the graphs capture): the encoder, then each
        decoder layer's cross K and V into the source pool at each token's pool entry.
        Shape: tokens [4, n] (rows SRC_ID, SRC_POSITION, POOL_TOKEN, SRC_ADAPTER: step_inputs.prefill_inputs);
        cu_seqlens [B + 1]; src_bound >= every source length."""
        lora = self.adapters.batch(tokens[SRC_ADAPTER], sites, self.backend.ops, tiled=True) if sites else None
        enc_out = self.model.encode(tokens[SRC_ID], tokens[SRC_POSITION], cu_seqlens, src_bound, lora)
        pool = tokens[POOL_TOKEN]
        for i in range(self.model.cfg.decoder_layers):
            k, v = self.model.cross_kv(i, enc_out, lora)
            self.table.cross_k[i].index_copy_(0, pool, k)
            self.table.cross_v[i].index_copy_(0, pool, v)
