"""The slot table: fixed-capacity decoder rows and a source-token pool, allocated once.

Static shapes are what make CUDA graphs possible, so nothing here grows after start. A row
holds one decoder hypothesis (a greedy segment takes 1 row, a beam segment `num_beams`) and its
self-attention KV for up to T target positions. A segment's cross-attention KV is written once
into a contiguous range of the source pool and shared by all of its beams.
"""
from __future__ import annotations

import heapq

import torch

from engine.config import ModelConfig


SOURCE_TOKENS_PER_ROW = 32  # source-pool capacity per row: NLLB sentences average well under this


def bytes_per_row(cfg: ModelConfig, target_len: int, dtype: torch.dtype) -> int:
    """Device bytes one row costs: its self-attention KV, its share of the source pool, and 8 bytes
    per vocabulary entry for logits (model-dtype static outputs of a bucket's graphs, one per source
    bound and LoRA site set, and selection's float32 working copies)."""
    item = torch.tensor([], dtype=dtype).element_size()
    kv_per_token = 2 * cfg.decoder_layers * cfg.d_model * item
    return kv_per_token * (target_len + SOURCE_TOKENS_PER_ROW) + 2 * 4 * cfg.vocab_size


class SlotTable:
    def __init__(self, cfg: ModelConfig, rows: int, target_len: int, source_tokens: int,
                 dtype: torch.dtype, device: torch.device):
        L, H, D = cfg.decoder_layers, cfg.decoder_heads, cfg.head_dim
        self.rows_total = rows
        self.target_len = target_len  # T: decoder positions per row
        self.source_tokens = source_tokens  # P: source-pool capacity in tokens
        self.scratch_row = rows  # one extra row, never allocated: filler rows of a padded step write here
        self.scratch_token = source_tokens  # one extra pool token, never allocated: a padded prefill's fillers
        self.self_k = torch.zeros(L, rows + 1, H, target_len, D, dtype=dtype, device=device)
        self.self_v = torch.zeros_like(self.self_k)
        # history[r, t]: the row whose cache holds position t of the hypothesis in row r. A beam
        # inherits its parent's history instead of copying its keys; rows only ever write their
        # own current position, so every position a history points at stays valid.
        self.history = torch.arange(rows + 1, dtype=torch.int32, device=device)[:, None].repeat(1, target_len)
        self.cross_k = torch.zeros(L, source_tokens + 1, H, D, dtype=dtype, device=device)
        self.cross_v = torch.zeros_like(self.cross_k)
        self.beam_scores = torch.zeros(rows + 1, dtype=torch.float32, device=device)  # [R] running beam score
        # a heap, so that a release costs O(log R): on ragged traffic tens of segments leave at every step
        self._free_rows = list(range(rows))
        self._free_ranges: list[tuple[int, int]] = [(0, source_tokens)]  # (start, length), sorted, none adjacent

    @property
    def rows_used(self) -> int:
        return self.rows_total - len(self._free_rows)

    @property
    def is_empty(self) -> bool:
        return self.rows_used == 0 and self._free_ranges == [(0, self.source_tokens)]

    def fits(self, rows: int, source_len: int) -> bool:
        """Whether `allocate` would succeed now."""
        return rows <= len(self._free_rows) and any(free >= source_len for _, free in self._free_ranges)

    def allocate(self, rows: int, source_len: int) -> tuple[list[int], int] | None:
        """Rows and a source range for one segment, or None when either is short (nothing taken)."""
        if rows > len(self._free_rows):
            return None
        start = self._take_range(source_len)
        if start is None:
            return None
        return [heapq.heappop(self._free_rows) for _ in range(rows)], start  # the lowest free rows

    def release(self, rows: list[int], ranges: list[tuple[int, int]]) -> None:
        """Rows and source ranges (start, length) back to the free lists, any number at once: a fixed batch's
        1,024 segments end in one step, where a heap push and a list insertion a segment took ~2 ms in all on the
        2-core machine."""
        if len(rows) == 1:
            heapq.heappush(self._free_rows, rows[0])
        else:
            self._free_rows.extend(rows)
            heapq.heapify(self._free_rows)
        merged: list[tuple[int, int]] = []
        for start, length in sorted(self._free_ranges + ranges):  # two sorted runs: one merge
            if merged and sum(merged[-1]) == start:  # joins the range before it
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free_ranges = merged

    def _take_range(self, length: int) -> int | None:
        """First fit; the pool is empty whenever the table is, so a fitting segment always runs."""
        for i, (start, free) in enumerate(self._free_ranges):
            if free >= length:
                if free == length:
                    del self._free_ranges[i]
                else:
                    self._free_ranges[i] = (start + length, free - length)
                return start
        return None
