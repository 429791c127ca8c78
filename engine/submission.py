"""Requests turned into jobs, on the submitter's thread: every check that can refuse a request (languages,
adapter, options, lengths), tokenization, a document's sentences (engine/documents.py), and the search each
segment runs. Refusals raise typed errors (engine.errors) that name what was asked, what is supported, and
what to do instead; a job that leaves here is valid.
"""
from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, replace
from functools import partial
from operator import attrgetter
from typing import Sequence

import numpy as np
import torch

from engine.beam_search import BeamSearch
from engine.config import GenerationDefaults, ModelConfig
from engine.documents import answer_document, plan_document
from engine.errors import InvalidRequest, TooLong, UnknownAdapter, UnknownLanguage
from engine.jobs import Job, OnSegment, Search, Segment, Source
from engine.languages import AUTO
from engine.lora import AdapterRegistry
from engine.options import GenerationOptions, JobFuture
from engine.search import SearchContext, SingleSearch
from engine.text.langid import DEFAULT_THRESHOLD, Detection, detect, detect_document
from engine.tokenizer import Tokenizer

ON_WARNING = ("flag", "retry")


@dataclass(frozen=True)
class JobSettings:
    """What every kind of job takes besides its sources and languages (Engine.submit's arguments)."""

    options: GenerationOptions | None = None
    adapter: str | None = None
    deadline: float | None = None  # epoch seconds
    on_warning: str = "flag"  # "retry": re-decode a flagged segment once (retry_options)
    job_id: str | None = None  # the name Engine.cancel knows the job by
    on_segment: OnSegment | None = None  # (answer position, Translation) from the engine thread
    check_outputs: bool = True  # False: the caller computes the warnings (but for on_warning="retry")


@dataclass(frozen=True)
class TextChecks:
    """What the engine judges of texts besides translating them (the worker's settings)."""

    langid_threshold: float = DEFAULT_THRESHOLD  # src_lang "auto": below this confidence, UnknownLanguage
    output_warnings: bool = True  # warnings on each text's translation (engine/text/quality.py); off: none


def id_lists(src_ids_batch: Sequence[Sequence[int]]) -> list[list[int]]:
    """A token-ids batch as lists of Python ints where it came as numpy (the batch, or its rows): their elements
    would otherwise be numpy scalars, and an array's truth value is ambiguous."""
    if isinstance(src_ids_batch, np.ndarray):
        return src_ids_batch.tolist()
    try:
        return [ids.tolist() if isinstance(ids, np.ndarray) else ids for ids in src_ids_batch]
    except TypeError:
        raise InvalidRequest("the sources must be a list of lists of token ids") from None


def retry_options(opts: GenerationOptions, rows_total: int) -> GenerationOptions:
    """A flagged segment's second decode: beam 4, repetition_penalty 1.2 and no_repeat_ngram_size 3 where the
    job left them at their defaults (what most often breaks a repetition loop), deterministic."""
    return replace(opts, num_beams=opts.num_beams if opts.num_beams > 1 else min(4, rows_total), do_sample=False,
                   repetition_penalty=opts.repetition_penalty if opts.repetition_penalty != 1.0 else 1.2,
                   no_repeat_ngram_size=opts.no_repeat_ngram_size or 3)


class JobBuilder:
    def __init__(self, cfg: ModelConfig, generation: GenerationDefaults, tokenizer: Tokenizer,
                 adapters: AdapterRegistry | None, device: torch.device, target_len: int, max_source_tokens: int,
                 rows_total: int, checks: TextChecks):
        self.cfg, self.generation, self.tokenizer, self.adapters = cfg, generation, tokenizer, adapters
        self.checks = checks
        self.device = device
        self.target_len = target_len  # decoder positions per row, the start token included
        self.max_source_tokens = max_source_tokens
        self.rows_total = rows_total

    def texts_job(self, texts: Sequence[str], src_lang: str, tgt_lang: str, settings: JobSettings) -> Job:
        """One segment per text; the future resolves to one Translation per text, in order."""
        if isinstance(texts, str) or not texts:
            raise InvalidRequest("texts must be a non-empty list of strings")
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text.strip():
                raise InvalidRequest(f"texts[{i}] is empty; send at least one non-blank character")
        if src_lang == AUTO:
            sources = [Source(text, *self._language(detect(text, self.checks.langid_threshold), f"texts[{i}]"))
                       for i, text in enumerate(texts)]
        else:
            self.tokenizer.lang_id(src_lang, "src_lang")  # validates the code before anything else
            sources = [Source(text, src_lang) for text in texts]
        return self._job([self.tokenizer.encode_source(s.text, s.lang) for s in sources], tgt_lang, settings,
                         [[i] for i in range(len(texts))], attrgetter("answers"), sources)

    def document_job(self, doc: str, src_lang: str, tgt_lang: str, settings: JobSettings, max_chars: int) -> Job:
        """One segment per distinct sentence (engine/documents.py); resolves to a DocumentTranslation."""
        if not isinstance(doc, str) or not doc.strip():
            raise InvalidRequest("the document is empty; send at least one non-blank character")
        if len(doc) > max_chars:
            raise TooLong(f"the document has {len(doc)} characters; this worker takes at most {max_chars}: "
                          "split it into several documents")
        if src_lang != AUTO:
            self.tokenizer.lang_id(src_lang, "src_lang")
        self.tokenizer.lang_id(tgt_lang, "tgt_lang")  # before the document is split
        if src_lang == AUTO:  # sentences by the language-neutral rules to detect on, then by the language's
            neutral = plan_document(doc, None, self.count_tokens, self.max_source_tokens)
            found = detect_document(neutral.unique, self.checks.langid_threshold)
            lang, confidence = self._language(found, "the document")
            plan = replace(plan_document(doc, lang, self.count_tokens, self.max_source_tokens),
                           detected_lang=lang, detected_confidence=confidence)
        else:
            plan = plan_document(doc, src_lang, self.count_tokens, self.max_source_tokens)
        sources = [Source(text, src_lang if src_lang != AUTO else plan.detected_lang, plan.detected_confidence)
                   for text in plan.unique]
        return self._job([self.tokenizer.encode_source(s.text, s.lang) for s in sources], tgt_lang, settings,
                         plan.positions, partial(answer_document, plan), sources)

    def ids_job(self, src_ids_batch: Sequence[Sequence[int]], tgt_lang: str, settings: JobSettings) -> Job:
        """Token ids in (each `[src_lang] pieces </s>`: lists of ints, or numpy rows); no text services (warnings
        need the source text)."""
        sources = id_lists(src_ids_batch)
        return self._job(sources, tgt_lang, settings, [[i] for i in range(len(sources))], attrgetter("answers"), None)

    @staticmethod
    def _language(found: Detection, what: str) -> tuple[str, float]:
        """The detected language and its confidence; UnknownLanguage with the best guesses when the identifier
        was not confident, or named a language NLLB does not translate."""
        if found.lang is None:
            guesses = ", ".join(f"{code} {score:.2f}" for code, score in found.guesses) or "none (no letters)"
            raise UnknownLanguage(f"src_lang 'auto': the language of {what} could not be identified with "
                                  f"confidence (best guesses: {guesses}); give src_lang")
        return found.lang, found.confidence

    def count_tokens(self, text: str) -> int:
        """The source tokens `text` takes as a segment: its pieces, the language code and </s>."""
        return len(self.tokenizer.encode_pieces(text)) + 2

    def _job(self, src_ids_batch: Sequence[Sequence[int]], tgt_lang: str, settings: JobSettings,
             positions: list[list[int]], resolve, sources: list[Source] | None) -> Job:
        opts = settings.options or GenerationOptions()
        forced_id = self.tokenizer.lang_id(tgt_lang, "tgt_lang")
        self._check_adapter(settings.adapter)
        max_length = self._max_length(opts)
        self._check_sources(src_ids_batch)
        if opts.num_beams > self.rows_total:
            raise InvalidRequest(f"num_beams={opts.num_beams} exceeds this worker's {self.rows_total} rows")
        if settings.on_warning not in ON_WARNING:
            raise InvalidRequest(f"on_warning={settings.on_warning!r} is not one of {', '.join(ON_WARNING)}")
        if settings.on_warning == "retry" and not self.checks.output_warnings:
            raise InvalidRequest("on_warning='retry' asked for, but this worker does not check outputs "
                                 "(output warnings are off); leave on_warning out")
        retry_search = None
        if settings.on_warning == "retry":
            retry_search = partial(self._search, retry_options(opts, self.rows_total), forced_id, max_length)
        job = Job(JobFuture(), settings.adapter, settings.deadline, positions, resolve, sources, tgt_lang,
                  settings.on_segment, retry_search, settings.job_id,
                  check_output=(sources is not None and self.checks.output_warnings
                                and (settings.check_outputs or settings.on_warning == "retry")))
        job.future.total = sum(map(len, positions))
        if opts.do_sample:  # a generator each
            job.segments = [Segment(job, i, list(ids), self._search(opts, forced_id, max_length))
                            for i, ids in enumerate(src_ids_batch)]
        else:  # one context for all: a call less a segment (~1 us; 1,024 segments in a fixed batch)
            shared, search = self._context(opts, forced_id, max_length), self._search_class(opts)
            job.segments = [Segment(job, i, list(ids), search(shared)) for i, ids in enumerate(src_ids_batch)]
        return job

    def _check_sources(self, src_ids_batch: Sequence[Sequence[int]]) -> None:
        """Every segment a non-empty list of integers, at most max_source_tokens long, its ids in the vocabulary:
        first over all of them at once, then, where that fails, the first segment at fault named."""
        if not src_ids_batch:
            raise InvalidRequest("no sources: send at least one list of token ids")
        vocab, limit = self.cfg.vocab_size, self.max_source_tokens
        try:
            # a float among the ids makes their sum a float (they would be cut to ints further on, silently)
            integral = isinstance(sum(map(sum, src_ids_batch)), numbers.Integral)
            if (integral and all(src_ids_batch) and max(map(len, src_ids_batch)) <= limit
                    and min(map(min, src_ids_batch)) >= 0 and max(map(max, src_ids_batch)) < vocab):
                return
        except TypeError:  # a source that is not a sequence, or holds what is not a number
            integral = False
        if not integral:
            raise InvalidRequest("each source must be a list of integer token ids")
        for i, ids in enumerate(src_ids_batch):
            if len(ids) > limit:
                raise TooLong(f"segment {i} has {len(ids)} source tokens; this worker accepts at most {limit}: "
                              "split the text into shorter segments")
            if not ids or min(ids) < 0 or max(ids) >= vocab:
                raise InvalidRequest(f"segment {i} holds token ids outside [0, {vocab})")

    def _max_length(self, opts: GenerationOptions) -> int:
        """HF max_length: the decoder start token plus max_new_tokens (default: the checkpoint's)."""
        max_length = 1 + opts.max_new_tokens if opts.max_new_tokens else self.generation.max_length
        if max_length > self.target_len:
            raise InvalidRequest(f"max_new_tokens={max_length - 1} exceeds this worker's limit of "
                                 f"{self.target_len - 1}; ask for fewer new tokens")
        return max_length

    def _check_adapter(self, adapter: str | None) -> None:
        if adapter is None:
            return
        if self.adapters is None:
            raise UnknownAdapter(f"adapter {adapter!r} asked for, but this worker serves no adapters "
                                 "(no adapters directory set); omit it for the base model")
        self.adapters.check(adapter)

    def _search(self, opts: GenerationOptions, forced_id: int, max_length: int) -> Search:
        """A new search on a context of its own (a sampling segment's generator is its own)."""
        return self._search_class(opts)(self._context(opts, forced_id, max_length))

    @staticmethod
    def _search_class(opts: GenerationOptions) -> type[Search]:
        return BeamSearch if opts.num_beams > 1 else SingleSearch

    def _context(self, opts: GenerationOptions, forced_id: int, max_length: int) -> SearchContext:
        generator = None
        if opts.do_sample:
            seed = opts.seed if opts.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            generator = torch.Generator(self.device).manual_seed(seed)
        return SearchContext(opts, self.cfg.decoder_start_token_id, forced_id, self.cfg.eos_token_id, max_length,
                             generator)
