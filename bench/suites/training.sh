#!/usr/bin/env bash
# Real `dflash-train train` runs on one GPU (1.7B shape, ShareGPT lengths): the target's layers compiled (the
# default) against eager, steady-state tokens/s from metrics.jsonl (bench/train_steady.py). ~9 minutes.
source "$(dirname "$0")/common.sh"
TORCH_LOGS=recompiles step train_compiled 280 "${TRAIN[@]}" run.dir=/tmp/run_c
step train_eager 240 "${TRAIN[@]}" run.dir=/tmp/run_e target.compile=false
step train_steady 30 python3 bench/train_steady.py /tmp/run_c /tmp/run_e --skip 40
cp /tmp/run_c/summary.json "$RESULTS/train-compiled-summary.json" 2>/dev/null
cp /tmp/run_e/summary.json "$RESULTS/train-eager-summary.json" 2>/dev/null
finish
