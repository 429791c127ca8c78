"""HF transformers `generate` on the same checkpoint: the oracle for the engine's outputs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import GenerationOptions


@dataclass
class OracleResult:
    tokens: list[list[int]]  # per returned sequence: ids after the language token, no </s>, no pad
    scores: list[float] | None  # sequences_scores (beam) or the greedy formula; None for sampling


def hf_generate(model, src_ids: list[int], forced_id: int, opts: GenerationOptions) -> OracleResult:
    """One segment alone (batch 1), so padding never blurs the comparison. Sampling seeds every device's
    default generator: on the GPU, HF draws from the CUDA one, the stream a fresh CUDA generator of that seed
    gives (the engine's)."""
    kwargs = dict(num_beams=opts.num_beams, num_return_sequences=opts.num_return_sequences,
                  length_penalty=opts.length_penalty, early_stopping=opts.early_stopping,
                  do_sample=opts.do_sample, temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p,
                  no_repeat_ngram_size=opts.no_repeat_ngram_size, repetition_penalty=opts.repetition_penalty,
                  min_new_tokens=opts.min_new_tokens, forced_bos_token_id=forced_id,
                  output_scores=True, return_dict_in_generate=True)
    if opts.max_new_tokens:
        kwargs["max_new_tokens"] = opts.max_new_tokens
        kwargs["max_length"] = None
    if opts.do_sample:
        torch.manual_seed(opts.seed)
    with torch.no_grad():
        out = model.generate(torch.tensor([src_ids], device=model.device), **kwargs)
    tokens = []
    for seq in out.sequences.tolist():
        ids = seq[2:]  # drop the decoder start and the forced language token
        if 2 in ids:
            ids = ids[:ids.index(2)]
        tokens.append([t for t in ids if t != 1])
    if opts.num_beams > 1:
        scores = out.sequences_scores.tolist()
    elif not opts.do_sample:
        generated = out.sequences[0, 1:]
        logprob = sum(float(s[0].log_softmax(-1)[t]) for s, t in zip(out.scores, generated.tolist()))
        scores = [logprob / len(generated) ** opts.length_penalty]
    else:
        scores = None
    return OracleResult(tokens, scores)
