"""The benchmark harness runs end to end on a CPU: tiny random checkpoint, quick workloads, HF included.

    python -m bench.run --device cpu --shape tiny --quick --out DIR
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_quick_cpu(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tests.fixtures.random_checkpoint", reason="random checkpoint writer not present")
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--device", "cpu", "--shape", "tiny", "--quick",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # ~25 s on an idle 2-core CI machine, of which importing transformers' M2M100 is 10-16 s; 60 s of slack
    assert time.perf_counter() - t < 60, f"smoke run took {time.perf_counter() - t:.1f}s"
    data = json.loads((tmp_path / "results.json").read_text())
    seen = {(r["workload"], r["engine"]) for r in data["results"]}
    for w in ("greedy_b16", "beam4_b64", "latency_greedy", "latency_beam4", "stream"):
        assert (w, "ours") in seen and (w, "hf") in seen, f"{w} missing from {sorted(seen)}"
    for r in data["results"]:
        assert r["seconds"] > 0 and r["tokens"] > 0 and 0 < r["pct_of_floor"]
    assert "| workload | engine |" in (tmp_path / "results.md").read_text()
