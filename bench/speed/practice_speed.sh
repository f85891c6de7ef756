#!/usr/bin/env bash
# Training tokens/s of configs/practice.yaml alone on one GPU, by setting: on this small target one run leaves the
# GPU part idle (arms sharing it trained more tokens/s together than one alone: bench/RESULTS.md, "Recipe levers at
# a longer budget"), and faster steps are more quality per GPU-minute. Each variant trains STEPS (default 400) steps
# on the practice target's multi-turn data, no evaluation; bench/speed/train_steady.py then prints each one's steady
# tokens/s (the first 100 steps, compile and warm-up, left out). VARIANTS picks them (default: all, base first).
# ~9 minutes for all. Carry .whl .practice .quality/turns4.
#   base             the recipe as it is (target eager, the drafter's forward compiled)
#   target-compiled  target.compile=true: the target's layers compiled too
#   cuda-graphs      train.compile_mode=reduce-overhead: the drafter's forward and backward in CUDA graphs
#   both             the two together
#   cudnn            target.cudnn_attention=true: SDPA may pick cuDNN's attention, which plans each new batch
#                    shape (bench/target/target_shapes.py); these 400 steps are in the first epoch, where most shapes are new
#   budget-32k       pipeline.token_budget=32768: twice the tokens (and blocks) a step, fewer launches per token
source "$(dirname "$0")/../common.sh"
declare -A VARIANT=([base]="" [target-compiled]="target.compile=true"
  [cuda-graphs]="train.compile_mode=reduce-overhead"
  [both]="target.compile=true train.compile_mode=reduce-overhead" [cudnn]="target.cudnn_attention=true"
  [budget-32k]="pipeline.token_budget=32768")
VARIANTS=${VARIANTS:-base target-compiled cuda-graphs both cudnn budget-32k}
for v in $VARIANTS; do
  [ -n "${VARIANT[$v]+set}" ] || { echo "unknown variant $v (${!VARIANT[*]})"; exit 2; }
done
practice_data || { finish; exit 1; }
dirs=()
for v in $VARIANTS; do
  # shellcheck disable=SC2086  # VARIANT[$v]: that variant's overrides
  TORCH_LOGS=recompiles step "speed-$v" 240 python3 -m dflash_trainer train "${PRACTICE[@]}" \
    run.dir="/tmp/practice-runs/$v" train.max_steps="${STEPS:-400}" train.max_minutes=null train.log_interval=50 \
    eval.at_end=false logging.report=false logging.progress=false run.device=cuda ${VARIANT[$v]}
  [ -f "/tmp/practice-runs/$v/metrics.jsonl" ] && dirs+=("/tmp/practice-runs/$v")
done
step steady 30 python3 bench/speed/train_steady.py "${dirs[@]}" --skip 100
for d in "${dirs[@]}"; do cp "$d/summary.json" "$RESULTS/practice-speed-$(basename "$d")-summary.json"; done
finish
