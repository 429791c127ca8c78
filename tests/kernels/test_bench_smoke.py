"""The benchmark harness runs end to end on a CPU: tiny random checkpoint, quick workloads, HF included
(the LoRA rows without HF).

    python -m bench.run --device cpu --shape tiny --quick --out DIR
"""
from __future__ import annotations

import json
import re
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
    for w in ("greedy_b16", "beam4_b64", "latency_greedy", "latency_beam4", "sample_b256", "latency_sample", "stream"):
        assert (w, "ours") in seen and (w, "hf") in seen, f"{w} missing from {sorted(seen)}"
    for r in data["results"]:
        assert r["seconds"] > 0 and r["tokens"] > 0 and 0 < r["pct_of_floor"]
    assert "| workload | engine |" in (tmp_path / "results.md").read_text()
    assert_lora_rows(tmp_path, ["greedy_b256_lora1", "greedy_b256_lora8", "greedy_b256_lora32"])


def assert_lora_rows(out: Path, workloads: list[str]) -> None:
    """Each LoRA row: ours only, tokens counted, its ratio to the same jobs without adapters (the two medians,
    runs in turns) said in results.md; greedy_b256_jobs ran once; the generated adapters are gone afterwards."""
    data = json.loads((out / "results.json").read_text())
    base = [r for r in data["results"] if r["workload"] == "greedy_b256_jobs" and r["engine"] == "ours"]
    assert len(base) == 1, "greedy_b256_jobs runs (once) whenever a LoRA row is asked for"
    md = (out / "results.md").read_text()
    for w in workloads:
        rows = [r for r in data["results"] if r["workload"] == w]
        assert [r["engine"] for r in rows] == ["ours"], f"{w}: {rows}"
        r = rows[0]
        assert r["seconds"] > 0 and r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["pct_of_floor"] > 0
        assert r["ratio_to_hf"] is None
        said = re.search(r"(\d+\.\d+)x no-adapter \(the same jobs without adapters, in turns: (\d+\.\d+) s / "
                         r"(\d+\.\d+) s\)", r["note"])
        assert said, r["note"]
        ratio, base_s, lora_s = map(float, said.groups())
        assert ratio == round(r["ratio_to_base"], 2) and base_s > 0 and lora_s > 0
        assert r["ratio_to_base"] == pytest.approx(base_s / lora_s, abs=0.01 + 0.002 / lora_s)  # 3 decimals shown
        assert f"| {w} | ours |" in md and r["note"][:60] in md
    lora_meta = data["meta"]["lora"]
    assert lora_meta["max_adapters"] == "32" and not Path(lora_meta["adapters_dir"]).exists()


@pytest.mark.slow
def test_bench_lora_row_alone_cpu(tmp_path):
    # a few seconds: no HF; greedy_b256_jobs is added before the LoRA row for its ratio
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--device", "cpu", "--shape", "tiny", "--quick",
                           "--skip-hf", "--workloads", "greedy_b256_lora8", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_lora_rows(tmp_path, ["greedy_b256_lora8"])
