"""The LM head's product with greedy's selection in its epilogue (Triton): each row's argmax and log-prob taken from
the logits while they are in registers, so the [N, V] logits are never written nor read back.

Why: at the batch rows a greedy step wrote N x V logits (525 MB at 1,024 rows of V = 256,206 bf16) and read them
again to select (`ops.greedy_select`, ~134 us at 1,024 rows). A persistent tile GEMM fed by the tensor memory
accelerator makes the same product as fast as cuBLAS (1,024 x 1,024 -> 256,256: 813 against 808 us), with fp32 sums
over K in order and one rounding to the model's dtype: cuBLAS's bits (tests/kernels/test_head_triton.py). Its
epilogue keeps, per row and tile of BN columns, the first largest logit and the sum of exps below it; a second
launch merges a row's tiles. Graph time, cuBLAS's product then greedy_select against this: 1,024 rows 895 -> 799
us, 256 rows 283 -> 248, 64 rows 163 -> 130, 16 rows 138 -> 127.

GPU only, Hopper only (sm_90: the tensor descriptors, and the tiles timed there). Where Triton is missing, the
rows are few (`tile`), the layout is not one the descriptors take, or a launch fails, `head_greedy` returns None
and the caller runs cuBLAS's product then greedy_select (logged once on a failure)."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("engine")

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a torch without Triton (or a Triton without host tensor descriptors): cuBLAS and the kernel
    triton = None

ENABLED = True  # False: cuBLAS's product then greedy_select everywhere (A/B timing)
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
_SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 0
MIN_ROWS = 16  # below, the product is a GEMV at the memory's bandwidth either way


def tile(m: int) -> tuple[int, int, int, int] | None:
    """(BM, BN, warps, stages) for m rows, or None: cuBLAS and greedy_select."""
    if m < MIN_ROWS:
        return None
    return (64, 256, 4, 4) if m <= 64 else (128, 256, 8, 3)


if triton is not None:
    _NO_INDEX = tl.constexpr(2 ** 31 - 1)  # an index above every column: min() over it leaves the real ones

    @triton.jit
    def _head_greedy_kernel(x_desc, w_desc, ban_ptr, part_max_ptr, part_idx_ptr, part_sum_ptr, M, V, K, eos,
                            LOGIT: tl.constexpr, BAN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr):
        tiles_m = tl.cdiv(M, BM)
        tiles_n = tl.cdiv(V, BN)
        # persistent: each program takes every PROGRAMS-th tile, in groups of GROUP_M row tiles so that the
        # programs running together share W's columns in L2; flattened, a tile's loads start under the last
        # one's epilogue
        for tile_id in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
            group = GROUP_M * tiles_n
            first_m = (tile_id // group) * GROUP_M
            size_m = min(tiles_m - first_m, GROUP_M)
            tm = first_m + (tile_id % group) % size_m
            tn = (tile_id % group) // size_m
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(0, K, BK):
                acc = tl.dot(x_desc.load([tm * BM, k]), w_desc.load([tn * BN, k]).T, acc)
            rm = tm * BM + tl.arange(0, BM)
            rn = tn * BN + tl.arange(0, BN)
            logit = acc.to(LOGIT).to(tl.float32)  # the model's logits, as cuBLAS rounds them
            logit = tl.where(rn[None, :] < V, logit, float("-inf"))  # the head's zero rows past V
            if BAN:
                banned = tl.load(ban_ptr + rm, mask=rm < M, other=0) != 0
                logit = tl.where(banned[:, None] & (rn[None, :] == eos), float("-inf"), logit)
            best = tl.max(logit, axis=1)
            first = tl.min(tl.where(logit == best[:, None], rn[None, :], _NO_INDEX), axis=1)
            below = tl.sum(tl.exp(logit - best[:, None]), axis=1)
            if tl.max((below != below).to(tl.int32), axis=0) > 0:
                # a NaN in the tile (else a row of +inf or of -inf only): a NaN counts as the largest, as in
                # torch.argmax, so such a row reports its first NaN, and NaN as its max. Rare (a broken model), so
                # its reduction is kept out of every other tile's epilogue.
                first_nan = tl.min(tl.where(logit != logit, rn[None, :], _NO_INDEX), axis=1)
                best = tl.where(first_nan < _NO_INDEX, float("nan"), best)
                first = tl.where(first_nan < _NO_INDEX, first_nan, first)
            at = rm * tiles_n + tn
            live = rm < M
            tl.store(part_max_ptr + at, best, mask=live)
            tl.store(part_idx_ptr + at, first, mask=live)
            tl.store(part_sum_ptr + at, below, mask=live)

    @triton.jit
    def _merge_kernel(part_max_ptr, part_idx_ptr, part_sum_ptr, token_ptr, logprob_ptr, tiles_n, BT: tl.constexpr):
        row = tl.program_id(0)
        t = tl.arange(0, BT)
        valid = t < tiles_n
        best = tl.load(part_max_ptr + row * tiles_n + t, mask=valid, other=float("-inf"))
        index = tl.load(part_idx_ptr + row * tiles_n + t, mask=valid, other=_NO_INDEX)
        below = tl.load(part_sum_ptr + row * tiles_n + t, mask=valid, other=0.0)
        nan = best != best
        first_nan = tl.min(tl.where(nan, index, _NO_INDEX), axis=0)
        top = tl.max(tl.where(nan, float("-inf"), best), axis=0)
        token = tl.min(tl.where(best == top, index, _NO_INDEX), axis=0)
        total = tl.sum(tl.where(best == float("-inf"), 0.0, below * tl.exp(best - top)), axis=0)
        # log_softmax at the argmax: top - (top + log total); NaN where the row holds a NaN or is all -inf
        logprob = tl.where((first_nan < _NO_INDEX) | (top == float("-inf")), float("nan"), -tl.log(total))
        tl.store(token_ptr + row, tl.where(first_nan < _NO_INDEX, first_nan, token).to(tl.int64))
        tl.store(logprob_ptr + row, logprob)


_failed = False


def takes(x: torch.Tensor, head: torch.Tensor) -> bool:
    """Whether `head_greedy` runs this product: Hopper, Triton, enough rows, bf16/fp16, and rows the tensor
    descriptors can address (unit column stride, 16-byte aligned rows)."""
    return (ENABLED and _HOPPER and triton is not None and not _failed and tile(x.shape[0]) is not None
            and x.dtype in (torch.bfloat16, torch.float16) and head.dtype == x.dtype
            and all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
                    for t in (x, head)))


def head_greedy(x: torch.Tensor, head: torch.Tensor, vocab: int, ban: torch.Tensor | None,
                ban_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Semantics: ops.head_greedy's, where `takes` holds; None where it does not, or where a launch failed.
    Shape: x [N, d]; head [V', d], V' >= vocab; ban [N] int64 or None
    Shape: token [N] int64; logprob [N] float32"""
    global _failed
    if not takes(x, head):
        return None
    try:
        return run(x, head, vocab, ban, ban_id, tile(x.shape[0]))
    except Exception as e:  # noqa: BLE001 - a compiler or driver failure: cuBLAS and greedy_select from now on
        _failed = True
        log.warning("the Triton LM head kernel failed (%s: %s); greedy rows take cuBLAS's product and "
                    "greedy_select", type(e).__name__, e)
        return None


def run(x: torch.Tensor, head: torch.Tensor, vocab: int, ban: torch.Tensor | None, ban_id: int,
        plan: tuple[int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`head_greedy`'s launches with the tile `plan` (BM, BN, warps, stages), whatever `tile` would choose
    (bench.kernels times the others)."""
    bm, bn, warps, stages = plan
    m, d = x.shape
    bk = 64
    tiles_n = triton.cdiv(vocab, bn)
    part_max = torch.empty(m * tiles_n, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(m * tiles_n, dtype=torch.int32, device=x.device)
    part_sum = torch.empty(m * tiles_n, dtype=torch.float32, device=x.device)
    token = torch.empty(m, dtype=torch.int64, device=x.device)
    logprob = torch.empty(m, dtype=torch.float32, device=x.device)
    programs = min(_SMS, triton.cdiv(m, bm) * tiles_n)
    logit = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
    _head_greedy_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(head, [bn, bk]),
        ban if ban is not None else token, part_max, part_idx, part_sum, m, vocab, d, ban_id, LOGIT=logit,
        BAN=ban is not None, BM=bm, BN=bn, BK=bk, GROUP_M=8, PROGRAMS=programs, num_warps=warps,
        num_stages=stages)
    _merge_kernel[(m,)](part_max, part_idx, part_sum, token, logprob, tiles_n, BT=triton.next_power_of_2(tiles_n),
                        num_warps=4)
    return token, logprob
