#!/usr/bin/env bash
# Speed on one GPU. PARTS picks what runs, in order (default "step"; each ~9 minutes on an H200, one a call):
#   step      the GPU tests, then ours against the naive baseline at the 1.7B and 8B shapes (fixed rows and the
#             ShareGPT length mix; bench/speed/run.py)
#   training  real `dflash-train train` runs (1.7B shape, ShareGPT lengths): the target's layers compiled (the
#             default) against eager, steady-state tokens/s from metrics.jsonl (bench/speed/train_steady.py)
#   [PARTS=training] bash bench/speed/speed.sh        (carry .whl and .whl-sharegpt: the ShareGPT lengths)
source "$(dirname "$0")/../common.sh"
for part in ${PARTS:-step}; do
  case $part in
    step)
      step gpu_tests 200 python3 -m pytest -q -x -m gpu tests/test_gpu.py
      step run_1p7b_mfu 130 python3 bench/speed/run.py --model qwen3-1.7b --workload mfu --out "$RESULTS"
      step run_8b_mfu 200 python3 bench/speed/run.py --model qwen3-8b --workload mfu --out "$RESULTS"
      step run_8b_sharegpt 200 python3 bench/speed/run.py --model qwen3-8b --workload sharegpt --out "$RESULTS" ;;
    training)
      TORCH_LOGS=recompiles step train_compiled 280 "${TRAIN[@]}" run.dir=/tmp/run_c
      step train_eager 240 "${TRAIN[@]}" run.dir=/tmp/run_e target.compile=false
      step train_steady 30 python3 bench/speed/train_steady.py /tmp/run_c /tmp/run_e --skip 40
      cp /tmp/run_c/summary.json "$RESULTS/train-compiled-summary.json" 2>/dev/null
      cp /tmp/run_e/summary.json "$RESULTS/train-eager-summary.json" 2>/dev/null ;;
    *) echo "unknown part $part (step, training)"; exit 2 ;;
  esac
done
finish
