#!/usr/bin/env bash
# The target forward on one GPU. PARTS picks what runs, in order (default "forward padded"):
#   forward  early exit and tap capture, eager vs compiled layers (Qwen3-8B shape)
#   padded   padded batches with and without the padding mask (taps checked against an fp32 run of each alone)
#   (the MoE, gpt-oss and TP=2 target parts: bench/large_targets/large_targets.sh)
source "$(dirname "$0")/../common.sh"
for part in ${PARTS:-forward padded}; do
  case $part in
    forward) step target_forward 200 python3 bench/target/target_forward.py --iters 3 ;;
    padded) step target_padded 150 python3 bench/target/target_padded.py ;;
    *) echo "unknown part $part (forward, padded)"; exit 2 ;;
  esac
done
finish
