"""The shapes the CUDA kernels take: the numbers the wrappers (kernels/ops*.py, kernels/checks.py) check on every
call and kernels/support.py checks once per model. They live apart from the wrappers so that the model check
imports without torch, CuPy or a GPU. Each is a property of the CUDA source named beside it."""
from __future__ import annotations

VEC = 8  # elements a thread moves with one 16-byte load: the rows the kernels read are multiples of it (vec8)
HEAD_DIMS = (8, 16, 32, 64, 128, 256)  # attention.cu: a key's D/8 lanes must divide a warp evenly
LN_MAX_D = 8 * 2 * 256  # embed_norm.cu: 8 elements x LN_CHUNKS pieces x 256 threads
BLOCK_THREADS_MAX = 1024  # CUDA's threads a block: kv_append_lora's block is a thread per 8 of q|k|v's H*D columns
LORA_OPT = 4  # lora.cu: outputs a thread of lora_apply's scalar version writes (its O a multiple of it)
LORA_MAX_RANK = 64  # lora.cu, embed_norm.cu: the rank h a block holds
LORA_MAX_SLOTS = 4096  # lora.cu's lora_tiles: three ints a slot in 48 KB of shared memory
TOPK_MAX = 128  # topk.cu: the longest sorted list a warp keeps
BEAM_MAX = 64  # beam.cu's shared arrays
INT32_MAX = 2**31 - 1  # sizes the kernels take as int (the vocabulary of the selection kernels)
