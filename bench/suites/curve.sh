#!/usr/bin/env bash
# One point of the scaling curve (real tau against GPU-minutes) on the practice target, longer than a device call:
# the training runs in its own process session, so it outlives the call that starts it, and a second call made
# while the machine is still warm (30 s) waits for it. Everything lives under /tmp/curve on the device.
#   PHASE=start [MINUTES=15] [PROMPTS=.quality/turns4] [NAME=...] bash bench/suites/curve.sh [our overrides ...]
#       regenerates the replies to PROMPTS (train_prompts.jsonl[.gz], eval_prompts.jsonl; `regenerate.*` overrides
#       apply), packs the data cache into $OUT (DATA_ONLY=1: and stops), starts the training, then follows it until
#       DEADLINE_S (570).
#   PHASE=wait bash bench/suites/curve.sh
#       follows the training to its end, evaluates its export alone (`dflash-train eval`, timed: the <= 20 s bar),
#       and brings back results.tar.gz.
# Carry .whl (omegaconf, datasets, dill, multiprocess), .practice/model and PROMPTS.
T0=$SECONDS
source "$(dirname "$0")/common.sh"
W=/tmp/curve; NAME=${NAME:-ours-${MINUTES:-15}min}
follow() {  # follow the training log until the run ends or DEADLINE_S seconds into this call
  while [ -e "$W/train.pid" ] && kill -0 "$(cat "$W/train.pid")" 2>/dev/null && (( SECONDS - T0 < ${DEADLINE_S:-570} )); do
    sleep 20; echo "[$((SECONDS - T0)) s] $(grep -E "step +[0-9]+|eval_tau|tau " "$W/train.log" | tail -n 1 | cut -c1-220)"
  done
}
if [ "${PHASE:-start}" = start ]; then
  rm -rf "$W"  # a warm machine keeps the last call's /tmp: never train on an earlier call's data
  mkdir -p "$W/cache" "$W/results" && cp -r src bench configs "$W/" && cp -r .practice/model "$W/target"
  PROMPTS=${PROMPTS:-.quality/turns4}
  if [ -e "$PROMPTS/train_prompts.jsonl.gz" ]; then gunzip -c "$PROMPTS/train_prompts.jsonl.gz" > "$W/cache/train_prompts.jsonl"
  else cp "$PROMPTS/train_prompts.jsonl" "$W/cache/"; fi
  cp "$PROMPTS/eval_prompts.jsonl" "$W/cache/"
  cd "$W" || exit 1
  export PYTHONPATH=$W/src:/tmp/site
  COMMON=(--target "$W/target" --cache "$W/cache")
  REGEN=(regenerate.batch_size=4096 regenerate.max_prompt_tokens=1024 "$@")
  step data 400 python3 bench/quality.py "${COMMON[@]}" --data-only "${REGEN[@]}"
  python3 bench/quality.py "${COMMON[@]}" --data-only --no-regen --pack "$OUT" > "$LOGS/pack.log" 2>&1
  grep -E "^data:|packed" "$LOGS/pack.log" | cut -c1-400
  if [ -n "${DATA_ONLY:-}" ]; then finish; exit 0; fi
  setsid nohup python3 bench/quality.py "${COMMON[@]}" --no-regen --runs "$W/runs" --results "$W/results" \
    --name "$NAME" "train.max_minutes=${MINUTES:-15}" "$@" > "$W/train.log" 2>&1 < /dev/null &
  echo $! > "$W/train.pid"
  echo "training $NAME started (pid $(cat "$W/train.pid")) at $((SECONDS - T0)) s"
  follow
else
  cd "$W" || exit 1
  export PYTHONPATH=$W/src:/tmp/site
  follow
fi
if ! kill -0 "$(cat "$W/train.pid")" 2>/dev/null; then  # the run ended: its result, and its export evaluated alone
  tail -n 5 "$W/train.log"
  export_dir=$(ls -d "$W"/runs/*/export 2>/dev/null | head -n 1)
  if [ -n "$export_dir" ]; then
    step eval-alone 300 python3 -m dflash_trainer eval --drafter "$export_dir" --out "$W/results/eval-alone" \
      eval.prompts="$W/cache/eval.jsonl" eval.num_prompts=40 eval.max_new_tokens=128 run.device=cuda
  fi
  cp "$W/train.log" "$LOGS/"; cp -r "$W"/results/* "$RESULTS/" 2>/dev/null
fi
echo "suite: $((SECONDS - T0)) s"
finish
