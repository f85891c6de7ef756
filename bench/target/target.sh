#!/usr/bin/env bash
# The target forward on one GPU. PARTS picks what runs, in order (default "forward padded"):
#   forward  early exit and tap capture, eager vs compiled layers (Qwen3-8B shape)
#   padded   padded batches with and without the padding mask (taps checked against an fp32 run of each alone)
#   moe      the Qwen3-30B-A3B shape (MFU by active experts) with a kernel profile of the capture forward
#   moe-experts  one compiled MoE layer's experts: transformers' grouped_mm combine against two others
#   tp-shared  a TP=2 target group with both ranks on one GPU (gloo): its taps against TP=1, compiled, then eager
#   gpt-oss  the gpt-oss-20b shape (flex attention with sinks, sliding layers), eager and compiled layers
source "$(dirname "$0")/common.sh"
for part in ${PARTS:-forward padded}; do
  case $part in
    forward) step target_forward 200 python3 bench/target_forward.py --iters 3 ;;
    padded) step target_padded 150 python3 bench/target_padded.py ;;
    moe) step target_forward_moe 400 python3 bench/target_forward.py --preset qwen3-30b-a3b --budgets 16384 \
           --iters 3 --profile ;;
    moe-experts) step moe_experts 150 python3 bench/moe_experts.py ;;
    gpt-oss) step target_forward_gpt_oss 300 python3 bench/target_forward.py --preset gpt-oss-20b --budgets 16384 \
           --iters 3 ;;
    tp-shared) step target_parallel 250 python3 bench/target_parallel.py
           step target_parallel_eager 250 python3 bench/target_parallel.py --eager ;;
    *) echo "unknown part $part (forward, padded, moe, moe-experts, gpt-oss, tp-shared)"; exit 2 ;;
  esac
done
finish
