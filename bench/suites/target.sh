#!/usr/bin/env bash
# The target forward on one GPU: early exit and tap capture (eager vs compiled layers), and padded batches with
# and without the padding mask (taps checked against an fp32 run of each sequence alone).
source "$(dirname "$0")/common.sh"
step target_forward 200 python3 bench/target_forward.py --iters 3
step target_padded 150 python3 bench/target_padded.py
finish
