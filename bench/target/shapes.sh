#!/usr/bin/env bash
# What the target forward costs the first time a job's batch shape is seen (bench/target/target_shapes.py): cuDNN's
# attention builds a plan for every new shape, and a first epoch meets one at almost every job (bench/RESULTS.md,
# "The target forward on new shapes"). Each variant (default, no-cudnn, pad-64, rounded, rounded-rows) in its own
# process, two passes over the same jobs (VARIANTS=a,b: those alone). PARTS picks the targets (default both;
# ~8 minutes):
#   practice  the practice target, 300 jobs of 16,384 tokens
#   8b        the Qwen3-8B shape cut to 10 decoder layers, random weights, 100 jobs
#   BENCH_COMMIT=<hash> [PARTS=practice] bash bench/target/shapes.sh    (carry .whl and .practice/model)
source "$(dirname "$0")/../common.sh"
ONLY=(); [ -n "${VARIANTS:-}" ] && ONLY=(--variants "$VARIANTS")
for part in ${PARTS:-practice 8b}; do
  case $part in
    practice) step shapes-practice 300 python3 bench/target/target_shapes.py --target .practice/model "${ONLY[@]}" \
          --out "$RESULTS" ;;
    8b) step shapes-8b 330 python3 bench/target/target_shapes.py --preset qwen3-8b --num-layers 10 --jobs 100 \
          "${ONLY[@]}" --out "$RESULTS" ;;
    *) echo "unknown part $part (practice, 8b)"; exit 2 ;;
  esac
done
finish
