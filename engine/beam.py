"""Beam search for one segment, with the semantics of HF transformers' `_beam_search`.

Per step: log-softmax, processors, add the running scores, keep the top 2 x num_beams
continuations over all beams; those ending in </s> (or at max_length) among the top num_beams
become finished hypotheses (score = sum log-prob / generated_len ** length_penalty), the best
num_beams unfinished ones run on. `early_stopping=True` stops when num_beams hypotheses are
finished; `False` stops when the best running beam, scored at the current length, cannot beat
the worst finished one. Floating-point operations follow HF's order so scores match bit for bit
on the same logits.
"""
from __future__ import annotations

import torch

from engine import processors
from engine.search import Candidate, Search, SearchContext

EXCLUDED = -1.0e9  # HF's "never pick this" score offset


class BeamSearch(Search):
    def __init__(self, ctx: SearchContext, vocab: int):
        nb, dev = ctx.options.num_beams, ctx.device
        self.ctx = ctx
        self.vocab = vocab
        self.rows = nb
        self.cur_len = 1
        self.running = torch.full((nb, ctx.max_length), ctx.start_id, dtype=torch.long, device=dev)
        self.running_scores = torch.zeros(nb, device=dev)  # [nb] sum log-prob of running beams
        self.running_scores[1:] = EXCLUDED  # only beam 0 expands at the first step
        self.finished = self.running.clone()  # [nb, max_length] finished hypotheses, best first
        self.finished_scores = torch.full((nb,), EXCLUDED, device=dev)  # length-normalised
        self.finished_len = torch.ones(nb, dtype=torch.long, device=dev)  # sequence lengths
        self.is_finished = torch.zeros(nb, dtype=torch.bool, device=dev)
        self.can_improve = True  # HF's is_early_stop_heuristic_unsatisfied
        self._done = False

    def next_tokens(self) -> list[int]:
        return self.running[:, self.cur_len - 1].tolist()

    def step(self, logits: torch.Tensor | None) -> list[int]:
        ctx, nb, V, t = self.ctx, self.rows, self.vocab, self.cur_len
        if t == 1:
            log_probs = processors.forced_scores(nb, V, ctx.forced_id, ctx.device)
        else:
            log_probs = processors.process(ctx.options, self.running[:, :t], logits.log_softmax(-1), ctx.eos_id)
        # 1. top 2 x nb continuations over all beams
        accumulated = (log_probs + self.running_scores[:, None]).view(1, -1)
        top_scores, top_index = torch.topk(accumulated, 2 * nb)
        top_scores, top_index = top_scores[0], top_index[0]
        parents, tokens = top_index // V, top_index % V
        candidates = self.running[parents]
        candidates[:, t] = tokens
        stops = (tokens == ctx.eos_id) | (t + 1 >= ctx.max_length)
        # 2. the best nb unfinished continuations run on
        run_scores = top_scores + stops.to(torch.float32) * EXCLUDED
        keep = torch.topk(run_scores, nb)[1]
        self.running, self.running_scores = candidates[keep], run_scores[keep]
        # 3. finished continuations among the top nb enter the finished set
        self._add_finished(candidates, top_scores, stops, t + 1)
        # 4. stopping
        self.cur_len = t + 1
        self._update_can_improve()
        self._done = not self.can_improve or bool(self.is_finished.all() and ctx.options.early_stopping) \
            or bool(stops.all())
        return parents[keep].tolist()

    def _add_finished(self, candidates: torch.Tensor, top_scores: torch.Tensor,
                      stops: torch.Tensor, new_len: int) -> None:
        nb, opts = self.rows, self.ctx.options
        just_finished = stops.clone()
        just_finished[nb:] = False
        scores = top_scores / ((new_len - 1) ** opts.length_penalty)
        full = bool(self.is_finished.all()) and opts.early_stopping
        scores = scores + float(full) * EXCLUDED
        scores = scores + float(not self.can_improve) * EXCLUDED
        scores = scores + (~just_finished) * EXCLUDED
        merged_scores = torch.cat((self.finished_scores, scores))
        best = torch.topk(merged_scores, nb)[1]
        lengths = torch.full((2 * nb,), new_len, dtype=torch.long, device=scores.device)
        self.finished = torch.cat((self.finished, candidates))[best]
        self.finished_scores = merged_scores[best]
        self.finished_len = torch.cat((self.finished_len, lengths))[best]
        self.is_finished = torch.cat((self.is_finished, just_finished))[best]

    def _update_can_improve(self) -> None:
        lp = self.ctx.options.length_penalty
        best_possible = self.running_scores[:1] / ((self.cur_len - 1) ** lp)
        worst = torch.where(self.is_finished, self.finished_scores.min(), EXCLUDED)
        self.can_improve = self.can_improve and bool((best_possible > worst).any())

    @property
    def done(self) -> bool:
        return self._done

    def results(self) -> list[Candidate]:
        n = self.ctx.options.num_return_sequences
        return [Candidate(self.finished[i, 1:int(self.finished_len[i])].tolist(), float(self.finished_scores[i]))
                for i in range(n)]
