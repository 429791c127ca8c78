"""bench/corpus.py: the corpus is seeded, its lengths are what the row says (log-normal sources around 26 tokens in
[4, 200], outputs 0.8-1.3x their source), and the peers' batching covers every sentence once, each batch at least as
long as each of its outputs."""
from __future__ import annotations

import re
import statistics
import subprocess
import sys

import pytest

from bench import corpus
from bench.workloads import Vocab, fixed_spec
from engine import TOY_MODEL_DIR
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def vocab():
    return Vocab(Tokenizer.load(TOY_MODEL_DIR))


def test_corpus_is_seeded_and_shaped_as_described(vocab):
    sentences = corpus.make_corpus(vocab, 4096, quick=False)
    assert sentences == corpus.make_corpus(vocab, 4096, quick=False)
    assert sentences != corpus.make_corpus(vocab, 4096, quick=False, seed=1)
    lengths = [len(s.source) for s in sentences]
    assert min(lengths) >= 4 and max(lengths) <= 200
    assert 24 <= statistics.median(lengths) <= 28
    assert len(set(lengths)) > 40, "ragged, not a few fixed lengths"
    for s in sentences:
        assert s.source[0] == vocab.tok.lang_id("eng_Latn") and s.source[-1] == 2
        assert round(0.8 * len(s.source)) <= s.new_tokens <= min(corpus.MAX_NEW, round(1.3 * len(s.source)))
    assert len({s.new_tokens for s in sentences}) > 40, "each sentence its own output length"


def test_peer_batches_cover_each_sentence_once_sorted_by_output(vocab):
    sentences = corpus.make_corpus(vocab, 1000, quick=False)
    batches = corpus.peer_batches(sentences, 256)
    assert [len(b) for b in batches] == [256, 256, 256, 232]
    flat = [s for b in batches for s in b]
    assert sorted(map(id, flat)) == sorted(map(id, sentences))
    assert [s.new_tokens for s in flat] == sorted(s.new_tokens for s in sentences)
    for b in batches:
        assert corpus.batch_length(b) == max(s.new_tokens for s in b)
    padded = sum(len(b) * corpus.batch_length(b) for b in batches)
    assert padded >= sum(s.new_tokens for s in sentences)


def test_step_timeline_logs_every_step_of_a_quick_cpu_run(tmp_path):
    """bench.step_timeline on the toy model: each workload's last run is placed in its steps (the last ends
    within the run), its finishing passes count every segment, and the engine thread's profile is written."""
    names = ["corpus_greedy", "corpus_beam4", "greedy_b256", "greedy_b1024"]
    proc = subprocess.run([sys.executable, "-m", "bench.step_timeline", "--quick", "--device", "cpu", "--out",
                           str(tmp_path), "--workloads", ",".join(names)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {line.split(":")[0]: line for line in proc.stdout.splitlines() if "wall median" in line}
    assert set(lines) == set(names)
    for line in lines.values():
        steps, on_device = map(int, re.search(r"(\d+) steps, (\d+) made on the device", line).groups())
        last_end, wall = map(float, re.search(r"the last ends ([\d.]+) ms in, of ([\d.]+)", line).groups())
        assert 0 < on_device < steps and last_end <= wall
        assert re.search(r"\d+ collector passes \(\d+ full\), [\d.]+ ms", line)
        assert re.search(r"segments: release [\d.]+, candidates [\d.]+, translations [\d.]+, texts waited [\d.]+, "
                         r"jobs [\d.]+ ms\)", line)  # the longest finishing pass, part by part
    finished = {name: int(re.search(r"(\d+) segments finished in \d+ passes", line).group(1))
                for name, line in lines.items()}
    for name in ("greedy_b1024", "greedy_b256"):  # every segment of bench.run's quick batch
        assert finished[name] == fixed_spec(name, quick=True).batch
    assert (tmp_path / "host_corpus_greedy.txt").read_text().count("function calls") == 2


def test_idle_gaps_split_short_launch_gaps_from_waits_for_the_host():
    """Overlapping kernels leave no gap; gaps under the cut count as short, the rest as long, listed longest first
    with where they start."""
    from bench.profile_steps import idle_gaps
    spans = [(0.0, 10.0), (5.0, 12.0), (15.0, 20.0), (120.0, 130.0), (8.0, 9.0), (1630.0, 1640.0)]
    assert idle_gaps(spans) == ("GPU span 1.64 ms: idle 0.00 ms in gaps under 10 us, 1.60 ms in longer ones "
                                "(2; longest 1500 us at 0.1 ms, 100 us at 0.0 ms)")
    assert idle_gaps(spans, listed=1).endswith("(2; longest 1500 us at 0.1 ms)")
    assert idle_gaps(spans, short_us=2000.0).endswith("idle 1.60 ms in gaps under 2000 us, 0.00 ms in longer ones "
                                                      "(0; longest none)")
