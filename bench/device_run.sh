#!/usr/bin/env bash
# Everything the GPU machine checks, in one run, each part's output under $OUT:
#   pytest    the GPU tests (pytest -m gpu tests/kernels tests/engine)             -> $OUT/pytest.txt
#   kernels   the kernel timings (python3 -m bench.kernels)                        -> $OUT/kernels.txt, kernels.json
#   profile   the step profile of three workloads (python3 -m bench.profile_steps) -> $OUT/profile.txt, $OUT/prof/
#   bench     the benchmark against HF and CTranslate2 (python3 -m bench.run)      -> $OUT/bench.txt, $OUT/bench/
#   ab        settings of one flag timed in turns in one engine (python3 -m bench.ab; not in the default parts):
#             AB_SET=module.attribute=baseline,value; AB_SHAPES, the random checkpoints' shapes (default 600M; a
#             shape's checkpoint is written once per machine to /tmp/ckpt-<shape>); AB_WORKLOADS, the rows (default:
#             those a step split could move; 1.3B and 3.3B: greedy_b256,beam4_b64 at up to 256 rows)
#             -> $OUT/ab-<shape>/ab.md
#   worker    one worker through a broker there, 1, 2 and 4 broker processes, and the engine alone
#             (python3 -m bench.worker_rate; not in the default parts: .broker/ must come along) -> $OUT/worker.txt
#
#   make gpu-deps                                     # here, once: what the GPU image lacks, into .gpu_deps/
#   bash bench/device_run.sh [workloads]              # on the GPU machine, .gpu_deps/ copied beside the checkout
#   PARTS="bench" bash bench/device_run.sh [workloads]   # some of the parts only (default: all four)
#   PROFILE=greedy_b1024,sample_b256 ...               # the profile's workloads (bench/profile_steps.py)
#   PARTS="pytest ab" AB_SET=engine.step_loop.SPLIT_ROWS=None,128 bash bench/device_run.sh
#   PARTS=ab AB_SHAPES="600M 3.3B" AB_SET=engine.step_loop.SPLIT_ROWS=None,128 bash bench/device_run.sh
#   bash bench/broker_bundle.sh pack; PARTS=worker BROKER_PROCESSES="1 4" MIXES="fixed stream" bash bench/device_run.sh
#
# The GPU image has torch, CuPy and transformers but not the engine's sentencex and py3langid, nor peft, which
# the GPU HF+PEFT parity test needs; .gpu_deps/ carries them (Makefile, gpu-deps). Nor has it CTranslate2 or the
# CUDA 12 cuBLAS CT2 needs: when the parts built by ../shared/tools/ct2-bundle.sh are in /tmp/stash with /tmp/zb
# beside them (that script's header says how to bring them), /tmp/zb/ct2-unpack.sh unpacks them to /tmp/site and
# /tmp/cu12 and the bench runs CT2 from there; without them the bench runs without CT2 and says so. The random
# checkpoints are written once per machine to /tmp/ckpt-<shape>. Each part has its own timeout, so a slow one
# still leaves the others' files in $OUT.
set -u
export PYTHONPATH="$PWD/.gpu_deps${PYTHONPATH:+:$PYTHONPATH}"
parts="${PARTS:-pytest kernels profile bench}"
workloads="${1:-greedy_b16,greedy_b256,greedy_b1024,beam4_b64,beam4_b256,latency_greedy,latency_beam4,sample_b256,latency_sample,greedy_b256_jobs,greedy_b256_lora32qv,greedy_b256_lora1,greedy_b256_lora8,greedy_b256_lora32,corpus_greedy,corpus_beam4,document,document_stream}"
run() { [[ " $parts " == *" $1 "* ]]; }

random_checkpoint() {  # shape -> /tmp/ckpt-<shape>, a random bf16 checkpoint, written on first use
    local dir="/tmp/ckpt-$1"
    [ -f "$dir/config.json" ] || python3 -c "
import torch
from bench.checkpoint import write_random_checkpoint
write_random_checkpoint('$dir', '$1', dtype=torch.bfloat16)" > /dev/null
    echo "$dir"
}
ckpt=$(random_checkpoint 600M)

if run pytest; then
    timeout 330 python3 -m pytest -m gpu tests/kernels tests/engine -q -s -p no:cacheprovider \
        > "$OUT/pytest.txt" 2>&1
    grep -E "passed|failed|error|agreement" "$OUT/pytest.txt" | tail -4
fi

if run kernels; then
    timeout 200 python3 -m bench.kernels --json "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1
    tail -1 "$OUT/kernels.txt"
fi

if run profile; then
    timeout 150 python3 -m bench.profile_steps --out "$OUT/prof" --model-dir "$ckpt" --kernels \
        --workloads "${PROFILE:-latency_greedy,latency_beam4,beam4_b256}" > "$OUT/profile.txt" 2>&1
    grep wall "$OUT/profile.txt"
fi

if run bench; then
    ct2_env=()
    if [ -d /tmp/stash ] && [ -f /tmp/zb/ct2-unpack.sh ] && bash /tmp/zb/ct2-unpack.sh; then
        ct2_env=(PYTHONPATH="/tmp/site:$PWD:$PYTHONPATH" LD_LIBRARY_PATH="/tmp/cu12${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
    fi
    env ${ct2_env[@]+"${ct2_env[@]}"} timeout 480 python3 -m bench.run --out "$OUT/bench" --model-dir "$ckpt" \
        --workloads "$workloads" > "$OUT/bench.txt" 2>&1
    grep -E "^CTranslate2 not run" "$OUT/bench.txt"
    grep "^|" "$OUT/bench/results.md"
fi

if run ab; then
    for shape in ${AB_SHAPES:-600M}; do
        if [ "$shape" = 600M ]; then
            rows=(--workloads "${AB_WORKLOADS:-greedy_b256,greedy_b1024,beam4_b64,beam4_b256,sample_b256,corpus_greedy}")
        else
            rows=(--workloads "${AB_WORKLOADS:-greedy_b256,beam4_b64}" --max-rows 256)
        fi
        echo "$shape"
        timeout 400 python3 -m bench.ab --model-dir "$(random_checkpoint "$shape")" --out "$OUT/ab-$shape" \
            --set "${AB_SET:?AB_SET=module.attribute=a,b}" "${rows[@]}" > "$OUT/ab-$shape.txt" 2>&1
        grep "^|" "$OUT/ab-$shape/ab.md" || tail -5 "$OUT/ab-$shape.txt"
    done
fi

if run worker; then  # 24,000 single-sentence jobs a run, as bench/RESULTS.md's worker tables
    # MIXES: bench.worker_rate's job mixes (fixed: 16 new tokens a job; stream: the arrival stream's sentences)
    if bash bench/broker_bundle.sh start > "$OUT/broker.txt" 2>&1; then
        for mix in ${MIXES:-fixed}; do
            for n in ${BROKER_PROCESSES:-1 2 4}; do
                echo "mix $mix, broker processes: $n"
                PYTHONPATH="/tmp/broker/site:$PYTHONPATH" timeout 240 python3 -m bench.worker_rate --model "$ckpt" \
                    --device cuda --jobs 24000 --new-tokens 16 --mix "$mix" --broker-processes "$n"
            done
            echo "mix $mix, the engine alone"
            PYTHONPATH="/tmp/broker/site:$PYTHONPATH" timeout 120 python3 -m bench.worker_rate --model "$ckpt" \
                --device cuda --jobs 24000 --new-tokens 16 --mix "$mix" --engine-only
        done > "$OUT/worker.txt" 2>&1
        grep -E "^mix|jobs_per_s" "$OUT/worker.txt" | cut -c1-160
    else
        tail -5 "$OUT/broker.txt"
    fi
fi
