#!/usr/bin/env bash
# Issue 38: where the drafter step's time goes at long context, and whether flex attention's kernel options or
# inductor's autotuning of them make it faster. The drafter step alone (bench/speed/drafter_step.py: the trainer's step,
# random taps and head) on one sequence of LEN tokens at the recipe's 512 blocks per 3,072 tokens, at the Qwen3-8B
# shape; the first variant is the reference of the speedup column; each is profiled (kernel kinds; PROFILE= skips it).
# H200 defaults (torch's sm90 heuristics, head dim 128, bf16): forward BLOCK_M 128, BLOCK_N 64, 3 stages, 8 warps;
# backward BLOCK_M1 64, BLOCK_N1 128, BLOCK_M2 128, BLOCK_N2 64, 3 stages, 8 warps. Each variant compiles (~55 s), so
# about four fit one device call at 32K:
#   [LEN=32768] [STEPS=5] bash bench/long_context/flex_options.sh                       # the default four below
#   VARIANTS="ours|autotune: train.compile_mode=max-autotune-no-cudagraphs" bash bench/long_context/flex_options.sh
# VARIANTS: drafter_step.py --variant texts separated by '|'. Carry .whl (omegaconf).
source "$(dirname "$0")/../common.sh"
LEN=${LEN:-32768}
K=drafter.flex_kernel_options
DEFAULT="ours|fwd 128x128 s2: $K.fwd_BLOCK_N=128 $K.fwd_num_stages=2"
DEFAULT+="|bwd 64x64 w4: $K.bwd_BLOCK_N1=64 $K.bwd_BLOCK_M2=64 $K.bwd_num_warps=4"
DEFAULT+="|bwd s2: $K.bwd_num_stages=2"
IFS='|' read -ra LIST <<< "${VARIANTS:-$DEFAULT}"
ARGS=()
for v in "${LIST[@]}"; do ARGS+=(--variant "$v"); done
[ -n "${PROFILE-1}" ] && ARGS+=(--profile)
step "flex-options-$LEN" "${LIMIT_S:-540}" python3 bench/speed/drafter_step.py --seqs 1 --seq-len "$LEN" \
  --blocks-per-seq $(( LEN * 512 / 3072 )) --steps "${STEPS:-5}" --warmup 2 "${ARGS[@]}" --out "$RESULTS"
finish
