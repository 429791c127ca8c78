"""A stand-in with the engine's API, for plumbing tests only (reverses/echoes the text).

It has its own thread, futures, a slot table of `rows_total` rows, deadlines checked before a job
takes rows, and EngineFailure on close — the parts of the contract the worker depends on.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from dataclasses import dataclass

from engine.errors import DeadlineExceeded, EngineFailure, InvalidRequest, TooLong, UnknownAdapter
from engine.languages import check_language
from engine.options import GenerationOptions, Hypothesis, Translation


@dataclass
class Stats:
    rows_total: int
    rows_used: int
    jobs_waiting: int
    jobs_running: int
    tokens_generated: int


class FakeEngine:
    model_name = "fake"
    max_source_tokens = 64

    def __init__(self, rows_total: int = 8, step_s: float = 0.002) -> None:
        self.rows_total = rows_total
        self.step_s = step_s
        self._q: queue.Queue = queue.Queue()
        self._tokens = 0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def submit(self, texts, src_lang, tgt_lang, options=None, adapter=None, deadline=None):
        check_language(src_lang, "src_lang")
        check_language(tgt_lang, "tgt_lang")
        if adapter is not None:
            raise UnknownAdapter(f"adapter {adapter!r} is not in the adapters directory")
        if any(not t for t in texts):
            raise InvalidRequest("empty text")
        if any(len(t.split()) > self.max_source_tokens for t in texts):
            raise TooLong("too long")
        if self._closed:
            raise EngineFailure("closed")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((fut, texts, tgt_lang, options or GenerationOptions(), deadline))
        return fut

    def _loop(self):
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, texts, tgt, opts, deadline = item
            if not fut.set_running_or_notify_cancel():
                continue
            if deadline is not None and time.time() > deadline:
                fut.set_exception(DeadlineExceeded("deadline passed before admission"))
                continue
            out = []
            for t in texts:
                words = t.split()
                if tgt == "deu_Latn":
                    words = words[::-1]
                toks = [len(w) for w in words]
                time.sleep(self.step_s * max(1, len(words)))
                hyps = [Hypothesis(" ".join(words), toks, -0.1 * i)
                        for i in range(opts.num_return_sequences)] if opts.num_return_sequences > 1 else []
                out.append(Translation(" ".join(words), toks, -0.1, hyps, len(words) + 2))
                self._tokens += len(toks)
            fut.set_result(out)

    def translate(self, texts, src_lang, tgt_lang, options=None, adapter=None):
        return self.submit(texts, src_lang, tgt_lang, options, adapter).result()

    def stats(self):
        return Stats(self.rows_total, 0, self._q.qsize(), 0, self._tokens)

    def close(self):
        self._closed = True
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[0].set_running_or_notify_cancel():
                item[0].set_exception(EngineFailure("engine closed"))
        self._q.put(None)
        self._thread.join(5)
