"""The benchmark harness runs end to end on a CPU: tiny random checkpoint, quick workloads, HF and CTranslate2
(when importable) included (the LoRA and document rows are ours only).

    python -m bench.run --device cpu --shape tiny --quick --out DIR
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import ct2

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_quick_cpu(tmp_path):
    # ~50 s on an idle 2-core machine (importing transformers' M2M100 alone is 10-16 s); the
    # timeout only catches a hang, since CI machines are shared and wall time is no signal here
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--device", "cpu", "--shape", "tiny", "--quick",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    for r in data["results"]:
        assert r["seconds"] > 0 and r["tokens"] > 0 and 0 < r["pct_of_floor"]
    header = "| workload | engine | time s | tokens | tokens/s | vs HF | vs CT2 |"
    assert header in (tmp_path / "results.md").read_text()
    assert_peer_rows(data, ["greedy_b16", "beam4_b64", "latency_greedy", "latency_beam4", "sample_b256",
                            "latency_sample", "stream", "corpus_greedy", "corpus_beam4"])
    assert_lora_rows(tmp_path, ["greedy_b256_lora1", "greedy_b256_lora8", "greedy_b256_lora32"])
    assert_document_rows(data)


def assert_peer_rows(data: dict, workloads: list[str]) -> None:
    """Each workload: ours, HF and (when importable) CT2, with the same tokens counted; ours' ratio to each peer is
    its tokens/s over the peer's; a peer decodes what was counted (fixed rows), or more (a corpus: its batches run as
    long as their longest output)."""
    peers = ["hf", "ct2"] if ct2.import_error() is None else ["hf"]
    assert data["meta"]["ct2"].startswith("4.") if "ct2" in peers else "not importable" in data["meta"]["ct2"]
    for w in workloads:
        rows = {r["engine"]: r for r in data["results"] if r["workload"] == w}
        assert sorted(rows) == sorted(["ours"] + peers), f"{w}: {sorted(rows)}"
        ours = rows["ours"]
        assert "produced" not in ours["note"] and "capture" not in ours["note"], ours["note"]
        for peer in peers:
            assert rows[peer]["tokens"] == ours["tokens"]
            assert ours[f"ratio_to_{peer}"] == pytest.approx(ours["tokens_per_s"] / rows[peer]["tokens_per_s"])
            if w.startswith("corpus"):
                decoded, counted = map(int, re.search(r"(\d+) tokens decoded for (\d+) counted",
                                                      rows[peer]["note"]).groups())
                assert counted == ours["tokens"] <= decoded and "expected" not in rows[peer]["note"]
            else:
                assert "decoded" not in rows[peer]["note"], rows[peer]["note"]
        if "ct2" not in peers:
            assert ours["ratio_to_ct2"] is None


def assert_document_rows(data: dict) -> None:
    """document: the document and the separate jobs, same tokens, ratio of their times said; document_stream: the
    single jobs alone and beside a document, each with p50 <= p99, the p99 ratio."""
    rows = {(r["workload"], r["engine"]): r for r in data["results"] if r["workload"].startswith("document")}
    assert sorted(rows) == [("document", "ours"), ("document", "ours-separate"),
                            ("document_stream", "ours"), ("document_stream", "ours-alone")]
    doc, jobs = rows["document", "ours"], rows["document", "ours-separate"]
    assert doc["tokens"] == jobs["tokens"] == 48 * 4
    assert doc["ratio_to_base"] == pytest.approx(jobs["seconds"] / doc["seconds"])
    said = re.search(r"document (\d+\.\d+) s, separate jobs (\d+\.\d+) s: (\d+\.\d+)x", doc["note"])
    assert said and float(said[3]) == round(doc["seconds"] / jobs["seconds"], 2), doc["note"]
    assert "split into" not in doc["note"] and "produced" not in doc["note"]
    beside, alone = rows["document_stream", "ours"], rows["document_stream", "ours-alone"]
    assert beside["tokens"] == alone["tokens"] > 0
    for r in (beside, alone):
        assert 0 < r["p50_ms"] <= r["p99_ms"]
    assert beside["p99_ratio"] == pytest.approx(beside["p99_ms"] / alone["p99_ms"])
    assert f"p99 {beside['p99_ratio']:.2f}x alone" in beside["note"]


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
