#!/usr/bin/env bash
# The second peer (issue 36): SpecForge's DFlash script (sgl-project/SpecForge 40d8fef with its in-process HF
# target, bench/peers/peer_specforge.py) trained for exactly STEPS steps per cell of PEER_CELLS ("NAME driver-option ...
# [-- its own arguments]", cells separated by ';'), side by side on the GPU (step-bound: sharing changes no result,
# only the wall time), each checkpoint evaluated by `dflash-train eval` on PROMPTS's held-out prompts (EVAL_PROMPTS=N:
# the first N) with EVAL_OVERRIDES (default target.dtype=float32, as the arms it is compared with). The cells run in
# their own process session, so they outlive the call that starts them:
#   PHASE=start [STEPS=1875] [PEER_CELLS="specforge-s0 --seed 0"] [PROMPTS=.quality/first200] \
#     bash bench/peers/peer_specforge.sh
#   PHASE=wait bash bench/peers/peer_specforge.sh      # follows them to the end and brings back results.tar.gz
# The init-matched 2x2 with 2 seeds: PEER_CELLS="specforge-random-s0 --seed 0;specforge-random-s1 --seed 1;
#   specforge-target-s0 --init target --seed 0;specforge-target-s1 --init target --seed 1"
# PRESET=qwen3-8b: the peer's step time at that shape instead: a random-weight target of the preset with the practice
# tokenizer (bench/peers/random_target.py), STEPS (default 30) steps per cell, one cell at a time, no evaluation
# (`step_s_after_warmup` in each JSON); default cells "specforge-8b-default;specforge-8b-anchors80 -- --num-anchors 80";
# RANDOM_TARGET_ARGS="--num-layers 6" with PRESET=qwen3-1.7b: a CPU check of the path.
# Carry .whl (yunchang 0.6.4 beside datasets, dill, multiprocess and pydantic: bench/README.md), .practice, .peer
# (.peer/specforge, its source at 40d8fef: bench/README.md) and PROMPTS (a data cache's quality-cache.tar.gz.part*).
# Not .whl-peer: the peer runs on the image's torch and transformers; nor sglang (the driver writes the one list
# its argument parser imports).
T0=$SECONDS
source "$(dirname "$0")/../common.sh"
W=/tmp/specforge
if [ -n "${PRESET:-}" ]; then
  STEPS=${STEPS:-30}; CELLS=${PEER_CELLS-"specforge-8b-default;specforge-8b-anchors80 -- --num-anchors 80"}
else
  STEPS=${STEPS:-1875}; CELLS=${PEER_CELLS-"specforge-s0 --seed 0"}
fi

run_cells() {  # PHASE=run (detached): the data cache, the target, the cells
  echo $$ > "$W/run.pid"
  PROMPTS=${PROMPTS:-.quality/first200}
  cat "$PROMPTS"/quality-cache.tar.gz.part* | tar xzf - -C "$W/cache" || { echo "no data cache in $PROMPTS"; return 1; }
  local target=$PWD/.practice/model opts=()
  if [ -n "${PRESET:-}" ]; then
    target=$W/target opts=(--no-eval)
    # shellcheck disable=SC2086  # RANDOM_TARGET_ARGS="--num-layers 6": a CPU check of the path
    python3 bench/peers/random_target.py --preset "$PRESET" --tokenizer .practice/model --out "$target" ${RANDOM_TARGET_ARGS:-} \
      > "$W/logs/target.log" 2>&1 || { echo "random target failed (logs/target.log)"; return 1; }
  else
    # shellcheck disable=SC2206  # the overrides split on spaces
    opts=(--eval-prompts "${EVAL_PROMPTS:-$(wc -l < "$W/cache/eval.jsonl")}"
          --eval-overrides ${EVAL_OVERRIDES:-target.dtype=float32})
  fi
  IFS=';' read -ra cells <<< "$CELLS"
  for cell in "${cells[@]}"; do
    read -r name cell_opts <<< "$cell"
    [ -z "$name" ] && continue
    echo "cell $name started at $((SECONDS - T0)) s"
    # shellcheck disable=SC2086  # the cell's options split on spaces
    python3 bench/peers/peer_specforge.py --target "$target" --cache "$W/cache" --work "$W/work/$name" --name "$name" \
      --max-steps "$STEPS" --results "$W/results" "${opts[@]}" $cell_opts > "$W/logs/$name.log" 2>&1 &
    [ -n "${PRESET:-}" ] && wait  # step times: each cell alone on the GPU
  done
  wait
  echo "cells done at $((SECONDS - T0)) s"
}

running() { [ -s "$W/run.pid" ] && kill -0 "$(cat "$W/run.pid")" 2>/dev/null; }

case "${PHASE:-start}" in
  run) run_cells; exit ;;
  start)
    running && kill -- -"$(cat "$W/run.pid")" 2>/dev/null
    rm -rf "$W" && mkdir -p "$W/cache" "$W/work" "$W/results" "$W/logs"
    PHASE=run setsid bash "$PWD/bench/peers/peer_specforge.sh" > "$W/run.log" 2>&1 < /dev/null &
    for _ in 1 2 3 4 5; do [ -s "$W/run.pid" ] && break; sleep 1; done
    echo "SpecForge cells started (pid $(cat "$W/run.pid" 2>/dev/null)): $CELLS" ;;
esac
while running && (( SECONDS - T0 < ${DEADLINE_S:-560} )); do
  sleep 30
  for log in "$W"/work/*/train.log; do  # its progress bar's "k/N" (the loss is logged every 50 steps)
    [ -e "$log" ] && echo "[$((SECONDS - T0)) s] $(basename "$(dirname "$log")"): step" \
      "$(grep -ao 'Training Epoch 0: [^[]*' "$log" | tail -n 1 | grep -o '[0-9]*/[0-9]*')"
  done
done
cat "$W/run.log" 2>/dev/null
if ! running; then
  for log in "$W"/logs/*.log; do echo "== $log"; tail -n 4 "$log"; done
  cp "$W"/run.log "$W"/logs/*.log "$LOGS/" 2>/dev/null
  for d in "$W"/work/*/; do
    cp "$d/train.log" "$LOGS/$(basename "$d")-train.log" 2>/dev/null
    cp "$d/eval/eval.json" "$RESULTS/eval-$(basename "$d").json" 2>/dev/null  # per-prompt counts: compare.py
  done
  cp "$W"/results/*.json "$RESULTS/" 2>/dev/null
else
  echo "still running: PHASE=wait bash bench/peers/peer_specforge.sh"
fi
echo "suite: $((SECONDS - T0)) s"
finish
