"""CTranslate2 as the bench's second peer beside HF `generate`: the checkpoint converted by ctranslate2's own
M2M100 loader (over HF's model, as a user's `ct2-transformers-converter` run would) and decoded with
`Translator.translate_batch` in the bench's process. Used when `import ctranslate2` works.

The bench's checkpoints carry the toy sentencepiece model and no HF tokenizer files, and an NllbTokenizer made
from a bare sentencepiece file has no language codes; so the vocabulary given to the converter is synthetic:
the four specials, then `<tI>` for id I. Only ids matter to a random model: sources, the forced language
token and the outputs map one to one onto the engine's ids.

bf16 on CUDA, float32 on the CPU (as the bench runs ours and HF). A conversion is kept in the temp directory,
keyed by the checkpoint's path, its weights' sizes and times and the compute type, since a 600M one takes
tens of seconds.
"""
from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0..3, as NLLB's
SAMPLING = dict(sampling_topk=50, sampling_topp=0.9)  # the sampling rows' warpers (bench.workloads.SAMPLING)


def import_error() -> str | None:
    """Why ctranslate2 cannot be used here (None: it can)."""
    try:
        import ctranslate2  # noqa: F401
    except Exception as exc:  # ImportError, or OSError for a missing CUDA library
        return f"{type(exc).__name__}: {exc}"
    return None


def token(i: int) -> str:
    """The synthetic vocabulary's string for id i."""
    return SPECIALS[i] if i < len(SPECIALS) else f"<t{i}>"


def token_id(s: str) -> int:
    return SPECIALS.index(s) if s in SPECIALS else int(s[2:-1])


def compute_type(device: str) -> str:
    return "bfloat16" if device == "cuda" else "float32"


def convert(model_dir: Path, out_dir: Path, quantization: str) -> Path:
    """ctranslate2's M2M100 conversion of the HF checkpoint in model_dir, with the synthetic vocabulary."""
    from ctranslate2.converters import Converter
    from ctranslate2.converters.transformers import M2M100Loader
    from transformers import M2M100ForConditionalGeneration

    class SyntheticVocabConverter(Converter):
        def _load(self):
            dtype = torch.bfloat16 if quantization == "bfloat16" else torch.float32
            model = M2M100ForConditionalGeneration.from_pretrained(model_dir, dtype=dtype)
            loader = M2M100Loader()
            spec = loader.get_model_spec(model)
            tokens = [token(i) for i in range(model.config.vocab_size)]
            cfg = spec.config
            cfg.bos_token, cfg.eos_token, cfg.unk_token = token(0), token(2), token(3)
            cfg.decoder_start_token = token(model.config.decoder_start_token_id)
            loader.set_vocabulary(spec, tokens)
            return spec

    return Path(SyntheticVocabConverter().convert(str(out_dir), quantization=quantization, force=True))


def cached_conversion(model_dir: Path, quantization: str) -> Path:
    """convert() into the temp directory, reused while the checkpoint's files are unchanged."""
    import ctranslate2

    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file())
    key = "|".join([str(Path(model_dir).resolve()), quantization, ctranslate2.__version__]
                   + [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files])
    out = Path(tempfile.gettempdir()) / f"nllb-bench-ct2-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if not (out / "model.bin").exists():
        tmp = out.with_name(out.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        convert(Path(model_dir), tmp, quantization)
        tmp.rename(out)
    return out


@dataclass
class CT2:
    translator: object  # ctranslate2.Translator

    @classmethod
    def load(cls, model_dir: Path, device: str) -> "CT2":
        """Convert (or reuse the conversion) and load a Translator; on the CPU it takes torch's thread count."""
        import ctranslate2

        path = cached_conversion(model_dir, compute_type(device))
        threads = dict(inter_threads=1, intra_threads=torch.get_num_threads()) if device == "cpu" else {}
        return cls(ctranslate2.Translator(str(path), device=device, compute_type=compute_type(device), **threads))

    @staticmethod
    def sources(batch: Sequence[Sequence[int]]) -> list[list[str]]:
        """Token-id sources (`[src_lang] pieces </s>`) as the token strings translate_batch takes."""
        return [[token(i) for i in s] for s in batch]

    def translate(self, sources: list[list[str]], forced_id: int, beams: int, new_tokens: int, sample: bool = False,
                  max_batch_size: int = 0) -> list:
        """Decode exactly `new_tokens` tokens a source (the forced language token first, as HF's
        max_new_tokens counts it); translate_batch's results (output_ids reads them outside the timing)."""
        return self.translator.translate_batch(
            sources, target_prefix=[[token(forced_id)]] * len(sources), beam_size=beams,
            min_decoding_length=new_tokens, max_decoding_length=new_tokens, max_batch_size=max_batch_size,
            **(SAMPLING if sample else {}))

    @staticmethod
    def output_ids(results: list) -> list[list[int]]:
        """The best hypothesis of each translate_batch result, as ids (the language token first)."""
        return [[token_id(t) for t in r.hypotheses[0]] for r in results]
