#!/usr/bin/env bash
# Issue 38: context parallel on a multi-GPU machine (kinds nvidia-h200-x2/x4/x8): real training runs on long
# sequences at the Qwen3-8B shape (bench/multi_gpu/context_parallel.py), one GPU first, then one CP group of each size in CP.
#   [SEQ_LEN=65536] [CP=2 on 2 GPUs, else 2,4] [STEPS=8] [RUN_S=280] [FLAGS="--set KEY=VALUE ..."] \
#     bash bench/multi_gpu/context_parallel.sh
#   SEQ_LEN=262144 CP=4 FLAGS=--no-baseline bash bench/multi_gpu/context_parallel.sh     # past what one GPU holds
# Carry .whl (omegaconf) and .quality/first200 (its train_prompts.jsonl.gz, or PROMPTS= another folder: the text the
# long conversations are made of: the device machine has no ShareGPT package).
# FLAGS="--set drafter.flex_kernel_options.BACKEND=FLASH" needs FA4 installed first (bench/long_context/fa4.sh).
source "$(dirname "$0")/../common.sh"
GPUS=$(nvidia-smi -L | wc -l)
[ "$GPUS" -ge 2 ] || { echo "context parallel needs 2+ GPUs, this machine has $GPUS"; finish; exit 1; }
TEXT=/tmp/cp-text.jsonl
zcat "${PROMPTS:-.quality/first200}"/train_prompts.jsonl.gz > "$TEXT" || { echo "carry ${PROMPTS:-.quality/first200}"; exit 1; }
CP=${CP:-$([ "$GPUS" -le 2 ] && echo 2 || echo 2,4)}
# shellcheck disable=SC2086  # FLAGS split on spaces
step "cp_${SEQ_LEN:-65536}" 590 python3 bench/multi_gpu/context_parallel.py --seq-len "${SEQ_LEN:-65536}" --cp "$CP" \
  --steps "${STEPS:-8}" --source "$TEXT" --timeout-s "${RUN_S:-280}" --out "$RESULTS" ${FLAGS:-}
finish
