"""The document rows: a whole text as one job against the same sentences as separate jobs, and a document's effect
on the latency of the single-sentence jobs beside it.

  document          a 2,000-sentence document submitted as one job (`Engine.submit_document`, eng_Latn ->
                    fra_Latn) against the same 2,000 sentences as 2,000 one-sentence `Engine.submit` jobs, all
                    submitted at once; runs of each taken in turns (median of each). Both decode every sentence
                    exactly NEW_TOKENS tokens. The document's time should be within 10% of the separate jobs'
                    (its ratio_to_base, separate time over document time, at least 1 / 1.1 = 0.91).
  document_stream   the arrival stream of single-sentence jobs (bench.workloads.make_stream, one segment a job),
                    alone and with one such document submitted at its start, in pairs of runs taken in turns;
                    the single jobs' p50/p99 latency of each side's median run and the ratio of their p99s (at
                    most 2x is the aim: the row cap of `max_rows_per_job` keeps rows free for them).

The document is made of the toy sentencepiece model's own words (the random checkpoints carry it, so every word
tokenizes into known pieces): sentences of 15-30 words, all distinct, each a capitalised word first and a full
stop last, joined by spaces with a line break after every few and a blank line now and then. Seeded. At ~240,000
characters it is over the worker's default document limit (100,000), so it is submitted with max_chars its length.
"""
from __future__ import annotations

import random
import statistics
from pathlib import Path

import sentencepiece as spm

from bench.ceilings import Shape, floor_seconds
from bench.report import Result, result
from bench.workloads import (Vocab, alternated_times, make_stream, peak_gib, peak_reset, percentile, submit_stream)

WORKLOADS = ("document", "document_stream")
SENTENCES = 2000  # --quick: 48
NEW_TOKENS = 32  # decoded a sentence (--quick: 4)
WORDS = (15, 30)  # words a sentence
SRC, TGT = "eng_Latn", "fra_Latn"
PAIRS = 5  # runs of the document and of the separate jobs, in turns (--quick: 2)
STREAM_PAIRS = 3  # runs of the stream alone and beside the document, in turns (--quick: 1)


def toy_words(model_dir: Path) -> list[str]:
    """The words of the checkpoint's sentencepiece model: pieces that start a word, letters only, 3 or more."""
    sp = spm.SentencePieceProcessor(model_file=str(Path(model_dir) / "sentencepiece.bpe.model"))
    pieces = (sp.id_to_piece(i) for i in range(sp.get_piece_size()))
    return sorted({p[1:] for p in pieces if p.startswith("\u2581") and p[1:].isalpha() and len(p) > 3})


def make_document(words: list[str], n: int, seed: int = 0) -> tuple[str, list[str]]:
    """A document of n distinct sentences (module doc), and its sentences in order."""
    rng = random.Random(seed)
    sentences: list[str] = []
    seen: set[str] = set()
    while len(sentences) < n:
        text = " ".join(rng.choice(words) for _ in range(rng.randint(*WORDS)))
        text = text[0].upper() + text[1:] + "."
        if text not in seen:
            seen.add(text)
            sentences.append(text)
    doc = sentences[0]
    for i, sentence in enumerate(sentences[1:], 1):
        doc += ("\n\n" if i % 40 == 0 else "\n" if i % 7 == 0 else " ") + sentence
    return doc, sentences


def _options(quick: bool):
    from engine import GenerationOptions
    n = 4 if quick else NEW_TOKENS
    return GenerationOptions(min_new_tokens=n, max_new_tokens=n)


def _document(eng, model_dir: Path, quick: bool) -> tuple[str, list[str], list[int]]:
    """The run's document, its sentences and their source lengths in tokens."""
    doc, sentences = make_document(toy_words(model_dir), 48 if quick else SENTENCES)
    return doc, sentences, [len(eng.tokenizer.encode_source(s, SRC)) for s in sentences]


def run_document(eng, model_dir: Path, shape: Shape, ceil: dict, args) -> list[Result]:
    """The document as one job against its sentences as separate jobs (module doc); ours only."""
    doc, sentences, lengths = _document(eng, model_dir, args.quick)
    opts = _options(args.quick)
    new = opts.max_new_tokens
    tokens = len(sentences) * new
    floor = floor_seconds(shape, [(n, new, 1) for n in lengths], ceil, 2 if args.device == "cuda" else 4)

    def as_document() -> object:
        return eng.submit_document(doc, SRC, TGT, opts, max_chars=len(doc)).result()

    def as_jobs() -> list:
        futures = [eng.submit([s], SRC, TGT, opts) for s in sentences]
        return [f.result()[0] for f in futures]

    eng.warm_up(eng.rows_total, max(lengths))
    translated = as_document()
    separate = as_jobs()
    notes = []
    if [s.source for s in translated.segments] != sentences:
        notes.append(f"the document was split into {len(translated.segments)} sentences, not {len(sentences)}")
    got = (sum(len(s.translation.tokens) for s in translated.segments), sum(len(t.tokens) for t in separate))
    if got != (tokens - len(sentences),) * 2:
        notes.append(f"produced {got[0]} (document) / {got[1]} (separate) tokens, expected "
                     f"{tokens - len(sentences)} + lang each")
    peak_reset(args.device)
    doc_s, jobs_s = alternated_times(as_document, as_jobs, args.device, pairs=2 if args.quick else PAIRS)
    said = (f"{len(sentences)} sentences, {new} tokens each; document {doc_s:.3f} s, separate jobs {jobs_s:.3f} s: "
            f"{doc_s / jobs_s:.2f}x their time (aim <= 1.10)")
    peak = peak_gib(args.device)
    return [result("document", "ours", doc_s, tokens, floor, peak, ratio_to_base=jobs_s / doc_s,
                   note="; ".join([said] + notes)),
            result("document", "ours-separate", jobs_s, tokens, floor, peak,
                   note=f"the same sentences as {len(sentences)} one-sentence jobs, all at once")]


def run_document_stream(eng, vocab: Vocab, model_dir: Path, shape: Shape, ceil: dict, args) -> list[Result]:
    """The single-sentence stream alone and with the document submitted as its first job arrives (module doc), in
    STREAM_PAIRS pairs taken in turns: the p99 of 160 jobs is their second slowest, and alone it moved 160-250 ms
    between runs, so each row gives the median run (by p99) and the ratio is of those medians. Tokens, tokens/s and
    the floor count the single jobs only."""
    doc, sentences, lengths = _document(eng, model_dir, args.quick)
    jobs = make_stream(vocab, max(args.stream_jobs, 16), args.stream_rate, args.quick, seed=1, single=True)
    tokens = sum(j.new_tokens for j in jobs)
    elem = 2 if args.device == "cuda" else 4
    floor = floor_seconds(shape, [(len(j.segments[0]), j.new_tokens, j.beams) for j in jobs], ceil, elem)
    eng.warm_up(eng.rows_total, max(lengths + [len(j.segments[0]) for j in jobs]))
    runs: dict[str, list[Result]] = {"ours-alone": [], "ours": []}
    doc_seconds: list[float] = []
    for _ in range(1 if args.quick else STREAM_PAIRS):
        for engine, rows in runs.items():
            peak_reset(args.device)
            document = None
            if engine == "ours":
                document = eng.submit_document(doc, SRC, TGT, _options(args.quick), max_chars=len(doc))
            lat = submit_stream(eng, jobs)
            wall = max(j.done for j in jobs) - jobs[0].arrival
            rows.append(result("document_stream", engine, wall, tokens, floor, peak_gib(args.device),
                               p50_ms=percentile(lat, 50), p99_ms=percentile(lat, 99)))
            if document is not None:
                usage = document.result().usage
                doc_seconds.append(usage.queued_s + usage.compute_s)  # from its submission to its last sentence
    alone, beside = (sorted(rows, key=lambda r: r.p99_ms)[len(rows) // 2] for rows in runs.values())
    beside.p99_ratio = ratio = beside.p99_ms / alone.p99_ms
    p99s = {engine: ", ".join(f"{r.p99_ms:.0f}" for r in rows) for engine, rows in runs.items()}
    alone.note = f"{len(jobs)} single-sentence jobs at {args.stream_rate}/s, alone; p99 of each run (ms): " \
                 f"{p99s['ours-alone']}"
    beside.note = (f"{len(jobs)} single-sentence jobs at {args.stream_rate}/s beside a {len(sentences)}-sentence "
                   f"document submitted at the start (answered after {statistics.median(doc_seconds):.2f} s; its "
                   f"tokens not counted); p99 of each run (ms): {p99s['ours']}; median p99 {ratio:.2f}x alone "
                   "(aim <= 2)")
    return [alone, beside]
