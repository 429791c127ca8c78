"""The benchmark harness runs end to end on a CPU: tiny random checkpoint, quick workloads, HF included.

    python -m bench.run --device cpu --shape tiny --quick --out DIR
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_quick_cpu(tmp_path):
    # ~25 s on an idle 2-core machine (importing transformers' M2M100 alone is 10-16 s); the
    # timeout only catches a hang, since CI machines are shared and wall time is no signal here
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--device", "cpu", "--shape", "tiny", "--quick",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    seen = {(r["workload"], r["engine"]) for r in data["results"]}
    for w in ("greedy_b16", "beam4_b64", "latency_greedy", "latency_beam4", "stream"):
        assert (w, "ours") in seen and (w, "hf") in seen, f"{w} missing from {sorted(seen)}"
    for r in data["results"]:
        assert r["seconds"] > 0 and r["tokens"] > 0 and 0 < r["pct_of_floor"]
    assert "| workload | engine |" in (tmp_path / "results.md").read_text()
