"""The corpus rows: a corpus like a user's instead of a fixed batch.

  corpus_greedy   4,096 sentences, greedy
  corpus_beam4    1,024 sentences, beam 4

Source lengths are log-normal around 26 tokens (median 26, sigma 0.5, clipped to [4, 200]); each sentence has its
own output length, 0.8-1.3x its source (at most 200, the models' max_length), decoded exactly
(min_new_tokens == max_new_tokens), so every engine does the same work. Seeded: the same corpus on every run.

Ours takes one job per sentence: every sentence is its own `submit_ids` job, all submitted at once, then all
waited for (continuous batching packs them). The peers get their own best batching: the sentences sorted by output
length (then source length), cut into batches of 256, each batch decoded as long as its longest output (so each
decodes at least its sentence's tokens: a batch's shorter outputs are padding). Tokens are counted as the sum of
the per-sentence lengths for every engine; a peer's note says how many it decoded.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

from bench.ceilings import Shape, floor_seconds
from bench.report import Result, length_notes, result, with_peer_ratios
from bench.workloads import Peers, Vocab, graph_count, median_time, peak_gib, peak_reset, peer_results

WORKLOADS = {"corpus_greedy": (4096, 1), "corpus_beam4": (1024, 4)}  # row -> (sentences, beams)
QUICK_SENTENCES = {"corpus_greedy": 32, "corpus_beam4": 8}
PEER_BATCH = 256  # sentences a peer batch (--quick: 8)
WARM_ROUNDS = 8  # the most untimed rounds of ours before the timed ones (run_corpus)
ROWS = 1024  # the engine's rows for these rows (as the fixed rows' widest batch; --quick: 16)
MEDIAN_SOURCE, SIGMA = 26, 0.5
MAX_NEW = 200
TGT = "fra_Latn"


@dataclass(frozen=True)
class Sentence:
    source: list[int]  # `[src_lang] pieces </s>`
    new_tokens: int  # decoded exactly, the language token included


def make_corpus(vocab: Vocab, n: int, quick: bool, seed: int = 0) -> list[Sentence]:
    """n sentences, source lengths log-normal around MEDIAN_SOURCE (--quick: around 8, at most 24) clipped to
    [4, 200], outputs 0.8-1.3x their source (at least 2: the language token and one more)."""
    rng = random.Random(seed)
    median, longest = (8, 24) if quick else (MEDIAN_SOURCE, 200)
    corpus = []
    for _ in range(n):
        length = min(longest, max(4, round(rng.lognormvariate(math.log(median), SIGMA))))
        new = min(MAX_NEW, max(2, round(length * rng.uniform(0.8, 1.3))))
        corpus.append(Sentence(vocab.source(rng, length), new))
    return corpus


def peer_batches(corpus: list[Sentence], size: int) -> list[list[Sentence]]:
    """The peers' batching: sorted by output length (then source length), cut into batches of `size`."""
    ordered = sorted(corpus, key=lambda s: (s.new_tokens, len(s.source)))
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def batch_length(batch: list[Sentence]) -> int:
    """A peer batch decodes as long as its longest output."""
    return max(s.new_tokens for s in batch)


def corpus_jobs(eng, corpus: list[Sentence], beams: int) -> Callable[[], list]:
    """Ours on the corpus: every sentence its own `submit_ids` job, all submitted at once, then all waited for; the
    call returns each sentence's Translation."""
    from engine import GenerationOptions
    opts = {k: GenerationOptions(num_beams=beams, min_new_tokens=k, max_new_tokens=k)
            for k in {s.new_tokens for s in corpus}}

    def ours() -> list:
        futures = [eng.submit_ids([s.source], TGT, opts[s.new_tokens]) for s in corpus]
        return [f.result()[0] for f in futures]
    return ours


def warm_up_corpus(eng, ours: Callable[[], list], corpus: list[Sentence], beams: int) -> None:
    """Every graph bucket up to the table's rows for each source bound the corpus reaches, then the corpus until two
    rounds in a row capture nothing. Which (bucket, bounds) its steps run depends on how fast segments end, so one
    quiet round left captures (25-100 ms each) inside the timed runs now and then."""
    rows, longest = min(eng.rows_total, len(corpus) * beams), max(len(s.source) for s in corpus)
    for src_tokens in sorted({1 << k for k in range(longest.bit_length())} | {longest}):
        eng.warm_up(rows, src_tokens, beams=beams)
    quiet = 0
    for _ in range(WARM_ROUNDS):
        before = graph_count(eng)
        ours()
        quiet = quiet + 1 if graph_count(eng) == before else 0
        if quiet == 2:
            break


def run_corpus(name: str, eng, peers: Peers, vocab: Vocab, shape: Shape, ceil: dict, args) -> list[Result]:
    """One corpus row: ours as one job per sentence, each peer on its batches (module doc)."""
    n, beams = WORKLOADS[name]
    corpus = make_corpus(vocab, QUICK_SENTENCES[name] if args.quick else n, args.quick)
    tokens = sum(s.new_tokens for s in corpus)
    elem = 2 if args.device == "cuda" else 4
    floor = floor_seconds(shape, [(len(s.source), s.new_tokens, beams) for s in corpus], ceil, elem)
    ours = corpus_jobs(eng, corpus, beams)
    warm_up_corpus(eng, ours, corpus, beams)
    before = graph_count(eng)
    peak_reset(args.device)
    seconds, out = median_time(ours, args.device)
    got = sum(len(t.tokens) for t in out)
    notes = [f"{len(corpus)} sentences as {len(corpus)} jobs, sources {min(len(s.source) for s in corpus)}-"
             f"{max(len(s.source) for s in corpus)} tokens", *length_notes(got, tokens - len(corpus))]
    if graph_count(eng) > before:
        notes.append(f"{graph_count(eng) - before} CUDA graph capture(s) inside the timing")
    rows = [result(name, "ours", seconds, tokens, floor, peak_gib(args.device), note="; ".join(notes))]

    batches = peer_batches(corpus, 8 if args.quick else PEER_BATCH)
    forced = vocab.tok.lang_id(TGT, "tgt_lang")
    per_batch = [peers.batch_runs([s.source for s in b], forced, beams, batch_length(b)) for b in batches]
    runs = {engine: (lambda calls=[r[engine] for r in per_batch]: [call() for call in calls])
            for engine in (per_batch[0] if per_batch else {})}
    decoded = sum(len(b) * batch_length(b) for b in batches)
    for r in peer_results(name, runs, tokens, floor, args.device, decoded):
        r.note = "; ".join(filter(None, [f"{len(batches)} batches sorted by output length, each as long as its "
                                         f"longest: {decoded} tokens decoded for {tokens} counted", r.note]))
        rows.append(r)
    return with_peer_ratios(rows)
