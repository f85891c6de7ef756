#!/usr/bin/env bash
# N-GPU scaling of real training runs on every GPU of the machine (kinds nvidia-h200-x2/x4/x8): one GPU,
# target:drafter splits and N colocated ranks, in one call (bench/multi_gpu/scaling.py).
#   bash bench/multi_gpu/scaling.sh [SPLITS]   (target-rank counts, comma list; default 1 on 2 GPUs, else 2,3,4)
source "$(dirname "$0")/../common.sh"
GPUS=$(nvidia-smi -L | wc -l)
SPLITS=${1:-$([ "$GPUS" -le 2 ] && echo 1 || echo 2,3,4)}
step "scaling_$GPUS" 580 python3 bench/multi_gpu/scaling.py --gpus "$GPUS" --splits "$SPLITS" --colocated-n --steps 30 \
  --timeout-s 280 --out "$RESULTS"
finish
