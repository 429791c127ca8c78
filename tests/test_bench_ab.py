"""bench/ab.py: settings of one attribute timed in turns, each with its own graphs, tokens compared with the first's."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import ab

REPO = Path(__file__).resolve().parents[1]


def fake_engine():
    graphs = SimpleNamespace(graphs={})
    return SimpleNamespace(graphs=graphs, prefill=SimpleNamespace(graphs=SimpleNamespace(graphs={})))


def test_each_setting_is_timed_with_its_own_value_and_graphs_and_its_tokens_compared_with_the_first():
    owner = SimpleNamespace(DELAY=None)
    settings = [ab.Setting(owner, "DELAY", v) for v in (0.002, 0.02)]
    eng = fake_engine()
    graphs_seen = []

    def run() -> list:
        graphs_seen.append((owner.DELAY, id(eng.graphs.graphs)))
        time.sleep(owner.DELAY)
        return [SimpleNamespace(tokens=[1, 2]), SimpleNamespace(tokens=[3] if owner.DELAY > 0.01 else [4])]

    rows = ab.compare("w", ab.Workload(run, lambda: None, 100), settings, eng, "cpu", pairs=3)
    assert [r["setting"] for r in rows] == ["DELAY=0.002", "DELAY=0.02"]
    assert rows[0]["vs_first"] == 1.0 and rows[1]["vs_first"] < 0.5  # ten times the delay
    assert rows[0]["tokens_per_s"] > 2 * rows[1]["tokens_per_s"]
    assert (rows[0]["same_segments"], rows[1]["same_segments"], rows[1]["segments"]) == (2, 1, 2)
    by_value = {}
    for value, graphs in graphs_seen:
        by_value.setdefault(value, set()).add(graphs)
    assert all(len(g) == 1 for g in by_value.values()) and len(set.union(*by_value.values())) == 2


@pytest.mark.parametrize("text", ["SPLIT_ROWS=1,2", "engine.step_loop.NO_SUCH=1,2", "engine.step_loop.SPLIT_ROWS=1"])
def test_a_setting_that_names_no_attribute_or_one_value_is_refused(text):
    with pytest.raises(ValueError):
        ab.parse_settings(text)


def test_ab_runs_fixed_and_corpus_rows_on_the_cpu(tmp_path):
    """On the CPU no step splits, so both settings must give every segment the same tokens."""
    proc = subprocess.run([sys.executable, "-m", "bench.ab", "--device", "cpu", "--quick", "--pairs", "2",
                           "--max-rows", "16", "--set", "engine.step_loop.SPLIT_ROWS=None,2",
                           "--workloads", "greedy_b256,corpus_greedy", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "ab.json").read_text())["rows"]
    assert [(r["workload"], r["setting"]) for r in rows] == [
        ("greedy_b256", "SPLIT_ROWS=None"), ("greedy_b256", "SPLIT_ROWS=2"),
        ("corpus_greedy", "SPLIT_ROWS=None"), ("corpus_greedy", "SPLIT_ROWS=2")]
    assert all(r["same_segments"] == r["segments"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert "| corpus_greedy | `SPLIT_ROWS=2` |" in (tmp_path / "ab.md").read_text()
