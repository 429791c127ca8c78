"""CUDA graphs of the decode step (decoder layers + LM head), one per row-count bucket, and of the
prefill (encoder + cross KV into the source pool), one per token-count bucket.

A decode step is a few hundred small launches; replayed as one graph it costs a fraction of
their launch overhead. Shapes are static per bucket: a step of n rows runs the graph of the
smallest bucket >= n, the extra rows pointing at the slot table's scratch row. A graph is also
specific to the bounds on source and decoder lengths it was planned with (the attentions' work
split), so decode graphs are keyed by (row bucket, StepBounds, LoRA), each bound a power of two or
the table's capacity. A step with any adapter row runs a graph that applies LoRA at the sites
installed adapters adapt, over the stacks of the slots below its slot bound (StepLora; None: the
base-model graph): each row reads its adapter slot from the inputs on the device, so one graph
serves any mix of adapters in those slots, including ones loaded after the capture (the stacks are
static tensors). Inputs are copied into one static buffer; the graph writes KV into the slot table
in place and logits into its static output. Graphs need the CUDA kernels (the reference ops read lengths on the host,
which a graph cannot).
The prefill works the same way over packed source tokens: keyed by (token bucket, source bound,
LoRA sites), filler tokens are sequences of their own whose cross KV goes to the pool's scratch token.
Eager, an encoder pass of a short source costs ~5 ms of Python and launches; a
replay a fraction of that. Packs over the largest bucket run eagerly: there the GPU work dominates.
Degrade, don't die: if a capture fails, the reason is logged once and that kind runs eagerly.
"""
from __future__ import annotations

import logging
from typing import Callable, Hashable, NamedTuple

import numpy as np
import torch

from engine.step_inputs import RowInputs

log = logging.getLogger("engine")


class StepBounds(NamedTuple):
    """What a decode graph's attention is planned for (its work split; ops.attention_plan): host bounds of every
    row's lengths, each a power of two or the table's capacity (step_loop.StepLoop.src_bound, target_bound)."""

    source: int  # >= every row's source length (the cross-attention)
    target: int  # >= every row's decoder length, its step's own key included (the self-attention)
    # runs of this many consecutive rows read one source (beam segments' rows; 1: none known): the cross-attention
    # loads a run's keys once (ops.cross_attention's `group`; step_inputs.rows_per_source)
    rows_per_source: int = 1


class StepLora(NamedTuple):
    """A decode graph's LoRA: where it applies adapters, and over which slots' stacks."""

    sites: frozenset  # every site an installed adapter adapts (lora.AdapterRegistry.installed_sites)
    slots: int  # the slot bound (AdapterRegistry.slot_bound): every row's slot is below it


class GraphSet:
    """Graphs of one function keyed by (size bucket, source bound, LoRA), the buckets powers of two up to the
    largest size (itself a bucket); what DecodeGraphs and EncoderGraphs share. LoRA is each set's own key:
    the sites (EncoderGraphs) or a StepLora (DecodeGraphs; None without LoRA)."""

    what = ""  # the graph in the log, of its bucket: "the decode step for %d rows"

    def __init__(self, smallest: int, largest: int):
        """Buckets: the powers of two from `smallest` (one itself) up to `largest`, and `largest`."""
        powers = range(smallest.bit_length() - 1, largest.bit_length() + 1)
        self.buckets = sorted({min(1 << i, largest) for i in powers})
        self.graphs: dict[tuple[int, Hashable, Hashable], object] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.enabled = True

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding n (None: n is over the largest)."""
        return next((b for b in self.buckets if b >= n), None)

    def capture_upto(self, n: int, bound: Hashable, lora: Hashable, smallest: int = 1) -> int:
        """Capture the graph of every bucket up to n's (the largest if n is over it), from `smallest`'s, for
        (bound, lora) not held yet, each on filler inputs; how many. `bound`: what the graphs are planned for
        (EncoderGraphs: the source bound; DecodeGraphs: StepBounds)."""
        top = self.bucket(min(n, self.buckets[-1]))
        first = self.bucket(min(smallest, top))
        captured = 0
        for key in [(b, bound, lora) for b in self.buckets if first <= b <= top]:
            if key in self.graphs or not self.enabled:
                continue
            self._fill(key[0])
            captured += self._try_capture(key)
        return captured

    def _try_capture(self, key: tuple[int, Hashable, Hashable]) -> bool:
        """Capture the graph of `key` from the static inputs as they are; False (and graphs off from now
        on) if the capture fails."""
        try:
            self.graphs[key] = self._capture(*key)
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run eagerly
            log.error("CUDA graph capture failed for %s (%s); it runs eagerly from now on", self.what % key[0], exc)
            self.enabled = False
            return False
        log.info("captured %s, %s, %s", self.what % key[0], self._bound_note(key[1]), self._lora_note(key[2]))
        return True

    @staticmethod
    def _lora_note(sites: frozenset) -> str:
        return f"LoRA at {len(sites)} sites"

    @staticmethod
    def _bound_note(bound: int) -> str:
        return f"sources up to {bound} tokens"

    def _fill(self, b: int) -> None:
        """Filler inputs for bucket b (a capture's warm-up run writes only the scratch row or token)."""
        raise NotImplementedError

    def _capture(self, b: int, bound: Hashable, lora: Hashable) -> object:
        raise NotImplementedError


class DecodeGraphs(GraphSet):
    what = "the decode step for %d rows"

    def __init__(self, step_fn: Callable[[RowInputs, StepBounds, StepLora | None, torch.Tensor], torch.Tensor],
                 max_rows: int, filler: RowInputs[torch.Tensor], logits_buffer: Callable[[int], torch.Tensor]):
        """step_fn(inputs of n rows, bounds, LoRA, out) -> logits [n, V] written into out; `filler`: max_rows rows a
        bucket's rows past a step's own read (the scratch row, adapter slot 0); logits_buffer(n): an empty buffer
        for step_fn's out."""
        super().__init__(1, max_rows)
        self.step_fn = step_fn
        self.inputs = RowInputs(filler.buffer.clone())  # the static inputs every graph reads
        self.filler = filler
        self.logits_buffer = logits_buffer
        # bucket -> the logits every graph of that bucket writes: one [b, V'] buffer (525 MB at 1,024 rows of 600M),
        # not one a graph, however many bounds and LoRA keys the bucket has graphs for. Sharing is safe because
        # a replay is queued after the selection that read the step before, as a graph's replays are already.
        self.outputs: dict[int, torch.Tensor] = {}

    def run(self, inputs: RowInputs[torch.Tensor], bounds: StepBounds, lora: StepLora | None) -> torch.Tensor | None:
        """Logits [n, V] for the n rows of device `inputs`, whose lengths are within `bounds`, with `lora` (None: no
        row has an adapter). None when graphs are off (run eagerly)."""
        if not self.enabled:
            return None
        n = inputs.size
        b = self.bucket(n)
        self.inputs.buffer[:, :n].copy_(inputs.buffer)
        if b > n:
            self.inputs.buffer[:, n:b].copy_(self.filler.buffer[:, n:b])
        key = (b, bounds, lora)
        if key not in self.graphs and not self._try_capture(key):
            return None
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:n]

    def _fill(self, b: int) -> None:
        self.inputs.buffer[:, :b].copy_(self.filler.buffer[:, :b])

    def _capture(self, b: int, bounds: StepBounds, lora: StepLora | None) -> tuple[object, torch.Tensor]:
        if b not in self.outputs:
            self.outputs[b] = self.logits_buffer(b)
        return capture(lambda: self.step_fn(self.inputs.columns(slice(0, b)), bounds, lora, self.outputs[b]),
                       self.pool)

    @staticmethod
    def _lora_note(lora: StepLora | None) -> str:
        return f"LoRA at {len(lora.sites)} sites over slots below {lora.slots}" if lora else "no LoRA"

    @staticmethod
    def _bound_note(bounds: StepBounds) -> str:
        runs = f", {bounds.rows_per_source} rows a source" if bounds.rows_per_source > 1 else ""
        return f"sources up to {bounds.source} tokens, targets up to {bounds.target}{runs}"


def capture(fn: Callable[[], object], pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """fn run once eagerly on a side stream (lazy initialisation, cuBLAS workspaces), then captured
    into a graph allocating from `pool`; returns the graph and fn's result (the graph's static output).
    The edges stay as captured: programmatic between kernels of ours, plain into cuBLAS's GEMMs (behind
    programmatic edges those gave other tokens: docs/performance.md, "CUDA graphs")."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


# A bucket of b tokens holds b // SEQ_SLOTS_PER sequences: the encoder's attention launches a block per
# sequence slot, head and 128 queries, empty slots included, and with a slot per token (b + 1 offsets) those
# blocks were most of the corpus rows' prefill time (a 2,048-token pack: 65k blocks, ~260 us a layer). A pack
# of k sources takes a bucket of at least SEQ_TOKENS x (k + 1) tokens, which leaves room for its k
# sequences and its fillers in sequences of FILLER_RUN tokens (k + 1 <= b / 16, fillers <= b / 32).
SEQ_SLOTS_PER, SEQ_TOKENS, FILLER_RUN = 8, 16, 32


def padded_pack(b: int, tokens: np.ndarray, cu_seqlens: np.ndarray, padding: np.ndarray) -> np.ndarray:
    """Bucket b's inputs for a pack (tokens [4, n], cu_seqlens [k + 1]; b >= EncoderGraphs.pack_size(n, k)), as
    the graph reads them: tokens [4, b], then cu [S + 1] with S = b // SEQ_SLOTS_PER. The n tokens come first, then
    b - n fillers (padding [4, 1]) in sequences of FILLER_RUN tokens at most (every source bound is at least that),
    then empty sequences up to S."""
    n, seqs, slots = tokens.shape[1], len(cu_seqlens) - 1, b // SEQ_SLOTS_PER
    host = np.empty(4 * b + slots + 1, dtype=np.int64)
    host[:4 * b].reshape(4, b)[:, :n] = tokens
    host[:4 * b].reshape(4, b)[:, n:] = padding
    cu = host[4 * b:]
    cu[:seqs + 1] = cu_seqlens
    cu[seqs + 1:] = np.minimum(n + FILLER_RUN * np.arange(1, slots - seqs + 1), b)
    return host


class EncoderGraphs(GraphSet):
    what = "the prefill of %d tokens"

    def __init__(self, prefill_fn: Callable[[torch.Tensor, torch.Tensor, int, frozenset], None], max_tokens: int,
                 padding: list[int], device: torch.device):
        """prefill_fn(tokens [4, n], cu_seqlens [S + 1], source bound, LoRA sites) encodes and writes the
        pool (tokens: step_inputs.prefill_inputs' rows); `padding`: a filler token's column (its adapter
        slot 0, its pool entry the scratch token)."""
        super().__init__(SEQ_TOKENS * 2, max_tokens)
        self.prefill_fn = prefill_fn
        self.padding = np.array(padding, dtype=np.int64)[:, None]
        # one static buffer: bucket b's graph reads tokens [4, b] from its first 4b entries, cu [S + 1] after
        self.buffer = torch.zeros(4 * max_tokens + max_tokens // SEQ_SLOTS_PER + 1, dtype=torch.long, device=device)

    @staticmethod
    def pack_size(tokens: int, sources: int) -> int:
        """The bucket size a pack of `sources` sources and `tokens` tokens in all needs (its bucket is the smallest
        at least this large)."""
        return max(tokens, SEQ_TOKENS * (sources + 1))

    def run(self, tokens: np.ndarray, cu_seqlens: np.ndarray, src_bound: int, sites: frozenset) -> bool:
        """Run the prefill of packed host inputs (tokens [4, n], cu_seqlens [k + 1]) in its bucket's graph;
        False (nothing ran) when graphs are off or the pack is over the largest bucket."""
        b = self.bucket(self.pack_size(tokens.shape[1], len(cu_seqlens) - 1))
        if not self.enabled or b is None:
            return False
        self._load(b, tokens, cu_seqlens)
        key = (b, src_bound, sites)
        if key not in self.graphs and not self._try_capture(key):
            return False
        self.graphs[key].replay()
        return True

    def _fill(self, b: int) -> None:
        self._load(b, np.zeros((4, 0), dtype=np.int64), np.zeros(1, dtype=np.int64))

    def _load(self, b: int, tokens: np.ndarray, cu_seqlens: np.ndarray) -> None:
        host = padded_pack(b, tokens, cu_seqlens, self.padding)
        self.buffer[:host.size].copy_(torch.from_numpy(host), non_blocking=True)  # see devices.upload

    def _capture(self, b: int, src_bound: int, sites: frozenset) -> object:
        tokens, cu = self.buffer[:4 * b].view(4, b), self.buffer[4 * b:4 * b + b // SEQ_SLOTS_PER + 1]
        return capture(lambda: self.prefill_fn(tokens, cu, src_bound, sites), self.pool)[0]
