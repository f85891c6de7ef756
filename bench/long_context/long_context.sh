#!/usr/bin/env bash
# Issue 38 on one H200 at the Qwen3-8B shape: a whole training step on one 128K-token sequence (bench/speed/run.py: the
# target forward up to its last tap, then the drafter step, chunked by the planner from the free memory), then
# the drafter step alone (bench/long_context/long_context.py): chunked and in one pass (the naive baseline) at BASELINE tokens,
# chunked alone at LENGTHS (one pass does not fit there).
#   [E2E=131072] [E2E_FLAGS=--eager-target] [BASELINE=32768] [LENGTHS=131072] [STEPS=2] \
#     bash bench/long_context/long_context.sh
# An empty E2E, BASELINE or LENGTHS skips that part; all three take longer than one device call (10 minutes): run
# E2E alone, then E2E= for the other two (each mode compiles for ~55 s). (E2E_FLAGS="" compiles the target's layers: faster steps, a longer start.) Carry .whl (omegaconf). Writes the
# JSONs and logs under $OUT (results.tar.gz).
source "$(dirname "$0")/../common.sh"
ARGS=(--warmup 1 --out "$RESULTS")
if [ -n "${E2E-131072}" ]; then
  step e2e "${E2E_S:-220}" python3 bench/speed/run.py --model qwen3-8b --workload mfu --seqs 1 --seq-len "${E2E:-131072}" \
    --blocks-per-seq $(( ${E2E:-131072} * 512 / 3072 )) --no-baseline ${E2E_FLAGS---eager-target} \
    --steps "${E2E_STEPS:-1}" "${ARGS[@]}"
fi
if [ -n "${BASELINE-32768}" ]; then
  step baseline "${BASELINE_S:-300}" python3 bench/long_context/long_context.py --modes chunked,one-pass \
    --lengths "${BASELINE:-32768}" --steps "${STEPS:-2}" "${ARGS[@]}"
fi
if [ -n "${LENGTHS-131072}" ]; then
  step chunked "${CHUNKED_S:-200}" python3 bench/long_context/long_context.py --modes chunked --lengths "${LENGTHS:-131072}" \
    --steps "${STEPS:-2}" "${ARGS[@]}"
fi
# the table and figure of every long-context point measured in this call (bench/long_context/long_context_figure.py)
python3 bench/long_context/long_context_figure.py "$RESULTS"/*.json --out "$RESULTS/long-context-memory.png" > "$LOGS/figure.log" 2>&1
cat "$LOGS/figure.log"
finish
