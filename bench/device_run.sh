#!/usr/bin/env bash
# Everything the GPU machine checks, in one run, each part's output under $OUT:
#   1. the GPU tests (pytest -m gpu tests/kernels tests/engine)             -> $OUT/pytest.txt
#   2. the kernel timings (python3 -m bench.kernels)                        -> $OUT/kernels.txt, kernels.json
#   3. the step profile of three workloads (python3 -m bench.profile_steps) -> $OUT/profile.txt, $OUT/prof/
#   4. the benchmark against HF (python3 -m bench.run)                      -> $OUT/bench.txt, $OUT/bench/
#
#   make gpu-deps                        # on this machine, once: peft + accelerate into the ignored .gpu_deps/
#   bash bench/device_run.sh [workloads] # on the GPU machine, with .gpu_deps/ copied beside the checkout
#
# The GPU image has torch, CuPy and transformers but no peft, which the GPU HF+PEFT parity test needs;
# .gpu_deps/ carries it (pure Python). The random 600M checkpoint is written once per machine to
# /tmp/ckpt-600M. Each part has its own timeout, so a slow one still leaves the others' files in $OUT.
set -u
export PYTHONPATH="$PWD/.gpu_deps${PYTHONPATH:+:$PYTHONPATH}"
ckpt=/tmp/ckpt-600M
workloads="${1:-greedy_b16,greedy_b256,greedy_b1024,beam4_b64,beam4_b256,latency_greedy,latency_beam4,sample_b256,latency_sample,greedy_b256_jobs,greedy_b256_lora32qv,greedy_b256_lora1,greedy_b256_lora8,greedy_b256_lora32}"

[ -f "$ckpt/config.json" ] || python3 -c "
import torch
from bench.checkpoint import write_random_checkpoint
write_random_checkpoint('$ckpt', '600M', dtype=torch.bfloat16)" > /dev/null

timeout 330 python3 -m pytest -m gpu tests/kernels tests/engine -q -s -p no:cacheprovider \
    > "$OUT/pytest.txt" 2>&1
grep -E "passed|failed|error|agreement" "$OUT/pytest.txt" | tail -4

timeout 200 python3 -m bench.kernels --json "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1
tail -1 "$OUT/kernels.txt"

timeout 150 python3 -m bench.profile_steps --out "$OUT/prof" --model-dir "$ckpt" --kernels \
    --workloads latency_greedy,latency_beam4,beam4_b256 > "$OUT/profile.txt" 2>&1
grep wall "$OUT/profile.txt"

timeout 300 python3 -m bench.run --out "$OUT/bench" --model-dir "$ckpt" --workloads "$workloads" \
    > "$OUT/bench.txt" 2>&1
grep "^|" "$OUT/bench/results.md"
