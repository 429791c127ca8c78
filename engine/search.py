"""Token selection for one segment: greedy and sampling (beam search lives in engine/beam.py).

A search owns its segment's decoder sequences; the step loop feeds it the logits of the
segment's rows and asks it which tokens to feed next, which rows to reorder, and when it is done.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import processors
from engine.options import GenerationOptions


@dataclass
class SearchContext:
    """The per-segment constants every search needs."""

    options: GenerationOptions
    start_id: int  # decoder start token (</s> for NLLB)
    forced_id: int  # target-language token forced at decoder length 1
    eos_id: int
    max_length: int  # decoder sequence cap, the start token included (HF max_length)
    generator: torch.Generator | None  # sampling only: this segment's own seeded RNG
    device: torch.device  # where logits live


@dataclass
class Candidate:
    """A finished sequence. `ids` are the generated ids after the start token, </s> included."""

    ids: list[int]
    score: float


class Search:
    """Interface of a per-segment search; one decoder row per hypothesis it keeps alive."""

    rows: int

    def next_tokens(self) -> list[int]:
        """The token each row feeds at the coming step (len == rows)."""
        raise NotImplementedError

    def step(self, logits: torch.Tensor | None) -> list[int] | None:
        """Consume this step's logits (None at decoder length 1, where the forced token needs
        none). Shape: logits [rows, V]. Returns the parent row of each row for the cache
        reorder, or None when the rows keep their own caches."""
        raise NotImplementedError

    @property
    def done(self) -> bool:
        raise NotImplementedError

    def results(self) -> list[Candidate]:
        """Best first; num_return_sequences of them."""
        raise NotImplementedError


class SingleSearch(Search):
    """Greedy (argmax) or sampling (multinomial on the warped distribution): one row."""

    rows = 1

    def __init__(self, ctx: SearchContext, vocab: int):
        self.ctx = ctx
        self.vocab = vocab
        self.ids = [ctx.start_id]
        self.logprob = 0.0
        self._done = False

    def next_tokens(self) -> list[int]:
        return [self.ids[-1]]

    def step(self, logits: torch.Tensor | None) -> None:
        ctx, opts = self.ctx, self.ctx.options
        if len(self.ids) == 1:
            scores = processors.forced_scores(1, self.vocab, ctx.forced_id, ctx.device)
        else:
            history = torch.tensor([self.ids], device=logits.device)
            scores = processors.process(opts, history, logits, ctx.eos_id)
        if opts.do_sample:
            probs = processors.warp(opts, scores).softmax(-1)
            token = int(torch.multinomial(probs, 1, generator=ctx.generator)[0, 0])
        else:
            token = int(scores[0].argmax())
        self.logprob += float(scores[0].log_softmax(-1)[token])
        self.ids.append(token)
        self._done = token == ctx.eos_id or len(self.ids) >= ctx.max_length
        return None

    @property
    def done(self) -> bool:
        return self._done

    def results(self) -> list[Candidate]:
        generated = len(self.ids) - 1
        return [Candidate(self.ids[1:], self.logprob / generated ** self.ctx.options.length_penalty)]
