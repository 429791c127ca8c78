"""The LoRA argument of the ops that adapt each row by its own adapter slot as they read a projection
(add_layer_norm, kv_append_lora in kernels/ops.py and kernels/reference.py): one value instead of three
tensors that must travel together."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SiteLora:
    """One projection site's adapters for a batch of rows: the site's slot-stacked weights, each row's slot and
    each slot's rank there. Slot 0 is the base model; weights past a slot's rank are read and dropped.
    Shape: stacks [S, P, R, width]: Bt [S, P, R, O] for a delta, A [S, 1, R, d] for add_layer_norm's shrink
    Shape: idx [N] int64 (0: no adapter)
    Shape: ranks [S] int32 (0: the slot's adapter leaves the site alone)"""

    stacks: torch.Tensor
    idx: torch.Tensor
    ranks: torch.Tensor
