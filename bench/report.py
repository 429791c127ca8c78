"""The bench's rows and how they are written: results.md (one table) and the console line per row."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

PEERS = ("hf", "ct2")  # the engines ours is compared with, row by row


@dataclass
class Result:
    workload: str
    engine: str  # "ours", "hf", "ct2", or a variant of ours that a row compares with ("ours-separate", ...)
    seconds: float
    tokens: int  # output tokens (best hypothesis per segment, the language token included), equal across engines
    tokens_per_s: float
    floor_seconds: float
    pct_of_floor: float
    peak_mem_gib: float
    ratio_to_hf: float | None = None  # ours tokens/s over HF tokens/s
    ratio_to_ct2: float | None = None  # ours tokens/s over CTranslate2 tokens/s
    ratio_to_base: float | None = None  # tokens/s over the row's base: LoRA rows, the same jobs without adapters
    #                                     (runs in turns); document, the same sentences as separate jobs
    p50_ms: float | None = None
    p99_ms: float | None = None
    p99_ratio: float | None = None  # document_stream: the single jobs' p99 beside a document over their p99 alone
    note: str = ""


def result(workload: str, engine: str, seconds: float, tokens: int, floor: float, peak: float, **extra) -> Result:
    """A row from its time, tokens and floor (tokens/s and % of floor computed)."""
    return Result(workload, engine, seconds, tokens, tokens / seconds, floor, 100 * floor / seconds, peak, **extra)


def length_notes(got: int, expected: int) -> list[str]:
    """A row's note when ours' outputs are not the lengths its options fix (min_new_tokens = max_new_tokens, so
    `expected` tokens after the language tokens): a wrong result, not a slow one, whose rate is not to be compared;
    the run also says so on stderr as it finds it."""
    if got == expected:
        return []
    note = f"WRONG LENGTHS: ours produced {got} tokens (expected {expected} + lang)"
    print(f"bench: {note}", file=sys.stderr, flush=True)
    return [note]


def with_peer_ratios(rows: list[Result]) -> list[Result]:
    """Set ours' ratio_to_hf / ratio_to_ct2 from the peers' rows of the same workload (where they ran)."""
    ours = [r for r in rows if r.engine == "ours"]
    for peer in PEERS:
        for r in rows:
            if r.engine == peer:
                for o in ours:
                    if o.workload == r.workload:
                        setattr(o, f"ratio_to_{peer}", o.tokens_per_s / r.tokens_per_s)
    return rows


def _fmt(x: float | None, fmt: str) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown(results: list[Result], meta: dict) -> str:
    ceil = meta["ceilings"]
    lines = [f"# bench: {meta['shape']} on {meta['device_name']}", "",
             f"copy bandwidth {ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s, "
             f"matmul {ceil['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s ({ceil['matmul_dtype']}); "
             f"CTranslate2 {meta.get('ct2') or 'not run'}; command: `{meta['command']}`", "",
             "| workload | engine | time s | tokens | tokens/s | vs HF | vs CT2 | % of floor | p50 ms | p99 ms "
             "| peak GiB | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.workload} | {r.engine} | {r.seconds:.3f} | {r.tokens} | {r.tokens_per_s:.0f} | "
                     f"{_fmt(r.ratio_to_hf, '.2f')} | {_fmt(r.ratio_to_ct2, '.2f')} | {r.pct_of_floor:.1f} | "
                     f"{_fmt(r.p50_ms, '.0f')} | {_fmt(r.p99_ms, '.0f')} | {_fmt(r.peak_mem_gib, '.2f')} | {r.note} |")
    return "\n".join(lines) + "\n"


def console_line(r: Result) -> str:
    """One row as the run prints it."""
    return (f"{r.workload:<18} {r.engine:<13} {r.seconds:8.3f}s {r.tokens_per_s:10.0f} tok/s "
            f"floor {r.pct_of_floor:5.1f}%  peak {r.peak_mem_gib:.2f} GiB"
            + (f"  x{r.ratio_to_hf:.2f} vs HF" if r.ratio_to_hf else "")
            + (f"  x{r.ratio_to_ct2:.2f} vs CT2" if r.ratio_to_ct2 else "")
            + (f"  x{r.ratio_to_base:.2f} vs base" if r.ratio_to_base else "")
            + (f"  p50 {r.p50_ms:.0f} ms p99 {r.p99_ms:.0f} ms" if r.p50_ms is not None else "")
            + (f"  p99 x{r.p99_ratio:.2f} of alone" if r.p99_ratio else ""))
