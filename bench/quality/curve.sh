#!/usr/bin/env bash
# One point of the scaling curve (real tau against GPU-minutes) on the practice target, longer than a device call:
# the training runs in its own process session, so it outlives the call that starts it, and a second call made
# while the machine is still warm (30 s) waits for it. Everything lives under /tmp/curve on the device (CURVE_DIR).
#   PHASE=start [MINUTES=15] [PROMPTS=.quality/turns4] [NAME=...] bash bench/quality/curve.sh [our overrides ...]
#       regenerates the replies to PROMPTS (train_prompts.jsonl[.gz], eval_prompts.jsonl; `regenerate.*` overrides
#       apply) unless PROMPTS holds them already (quality-cache.tar.gz.part*, from an earlier call), packs the
#       data cache into $OUT (DATA_ONLY=1: and stops), starts the training, then follows it until DEADLINE_S (570).
#   PHASE=wait bash bench/quality/curve.sh
#       follows the training to its end and brings back results.tar.gz. In either phase each run's export is
#       evaluated alone (`dflash-train eval`, timed: the <= 20 s bar; EVAL_OVERRIDES="k=v ..." apply to it alone, e.g.
#       target.quantize=null) as soon as that run ends, beside the arms still training; what ended comes back.
# EVAL=DIR: evaluate on DIR/eval_prompts.jsonl instead (e.g. more held-out prompts, `bench/quality/quality.py --prompts-only
# --eval-prompts 200`): their replies are regenerated, the training set's are kept.
# ARMS=FILE [PARALLEL=K] trains the arms of FILE (bench/quality/arms/) instead, K at a time (default all) sharing the GPU,
# each for MINUTES: levers compared at equal wall time over more than one call. EVAL_PARALLEL=K (kept for the
# wait call, as EVAL_OVERRIDES) evaluates K exports at once: the same tau, but their `seconds` are not the alone
# figure; an evaluation starts only with EVAL_MIN_S (70) seconds left before DEADLINE_S. DATA2=DIR unpacks a second
# data cache (DIR/quality-cache.tar.gz.part*) into /tmp/curve/data2, for arms
# that train on data.path=/tmp/curve/data2/train. REGEN2="regenerate.k=v ..." answers PROMPTS's training prompts a
# second time with the practice recipe and these settings (e.g. sampled replies: regenerate.num_samples=2
# regenerate.temperature=0.8; repeat the first regeneration's max_turns and max_prompt_tokens) into
# /tmp/curve/regen2/train, for arms that train on it (data.path=... or a data.sources mix). It must finish within
# the start call, or nothing trains. Its output comes back as regen2-cache.tar.gz.part*: put them in PROMPTS and a
# later call with the same REGEN2 resumes from them (nothing left to answer; other settings are refused).
# SYNTH="synthesize.k=v ..." has the practice target write its own prompts and answer them (`dflash-train synthesize`,
# answers with the practice recipe's regenerate settings and any regenerate.* given here) into /tmp/curve/synth/train,
# within the start call, as REGEN2 (resumed from PROMPTS/synth-cache.tar.gz.part*, brought back as such).
# Carry .whl (omegaconf, datasets, dill, multiprocess), .practice/model and PROMPTS. DEVICE=cpu (with a small
# pipeline.token_budget and data.max_length, and EVAL= a folder of a few prompts) checks the flow on a machine without
# a GPU; there an evaluation beside the training may run past its 120 s (the next PHASE=wait call evaluates it).
T0=$SECONDS
source "$(dirname "$0")/../common.sh"
W=${CURVE_DIR:-/tmp/curve}; NAME=${NAME:-ours-${MINUTES:-15}min}
[[ ${EVAL_PARALLEL:-1} =~ ^[1-9][0-9]*$ ]] || { echo "EVAL_PARALLEL=$EVAL_PARALLEL: a count >= 1 expected"; exit 2; }
if [ "${PHASE:-start}" = start ]; then EVAL_PARALLEL=${EVAL_PARALLEL:-1} EVAL_OVERRIDES=${EVAL_OVERRIDES:-}; fi
EVALS=$W/evals-$$  # the evaluations started by this call (a later call starts any that one cut short)
EVAL_PIDS=()
evaluate_ended() {  # evaluate_ended [all]: start the evaluation alone of each run that ended (its result JSON is
  # written; `all`: every run with an export, once the training has ended), at most EVAL_PARALLEL at once; returns 1
  # when one waits for a free place
  local export_dir name left running pid
  for export_dir in "$W"/runs/*/export; do
    [ -d "$export_dir" ] || continue
    name=$(basename "$(dirname "$export_dir")")
    [ -e "$W/results/eval-alone-$name/eval.json" ] || [ -e "$EVALS/$name" ] && continue  # done, or under way
    [ "${1:-}" = all ] || ls "$W"/results/*-quality-"$name".json > /dev/null 2>&1 || continue  # still training
    running=0; for pid in "${EVAL_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && running=$((running + 1)); done
    (( running < EVAL_PARALLEL )) || return 1  # the next round starts it
    # an evaluation gets up to 120 s, never past the deadline; one cut short leaves no eval.json (the next call's)
    left=$(( ${DEADLINE_S:-570} - (SECONDS - T0) - 10 ))
    if (( left < ${EVAL_MIN_S:-70} )); then  # too little left for one evaluation of the held-out prompts
      echo "eval of $name left to the next PHASE=wait"; mkdir -p "$EVALS" && touch "$EVALS/$name"; continue
    fi
    mkdir -p "$EVALS" && touch "$EVALS/$name"
    # shellcheck disable=SC2086  # EVAL_OVERRIDES: overrides of this evaluation alone, e.g. target.quantize=null
    step "eval-alone-$name" $(( left < 120 ? left : 120 )) python3 -m dflash_trainer eval --drafter "$export_dir" \
      --out "$W/results/eval-alone-$name" \
      eval.prompts="$W/cache/eval.jsonl" eval.num_prompts="$(wc -l < "$W/cache/eval.jsonl")" eval.max_new_tokens=128 \
      "run.device=${DEVICE:-cuda}" $EVAL_OVERRIDES &
    EVAL_PIDS+=($!)
  done
  return 0
}
follow() {  # follow the training log until the run ends or DEADLINE_S seconds into this call, evaluating the runs
  # that end meanwhile
  while [ -e "$W/train.pid" ] && kill -0 "$(cat "$W/train.pid")" 2>/dev/null \
      && (( SECONDS - T0 < ${DEADLINE_S:-570} )); do
    sleep "${FOLLOW_S:-20}"  # between looks at the logs
    newest=$(ls -t "$W/train.log" "$W"/runs/*.log 2>/dev/null | head -n 1)  # the arm that logged last
    echo "[$((SECONDS - T0)) s] $(grep -hE "step +[0-9]+|eval_tau|tau |^started|^finished" "$newest" 2>/dev/null \
      | tail -n 1 | cut -c1-220)"
    evaluate_ended
  done
}
if [ "${PHASE:-start}" = start ]; then
  # a warm machine keeps the last call's /tmp and processes: never train beside, or on the data of, an earlier run
  [ -e "$W/train.pid" ] && kill -- -"$(cat "$W/train.pid")" 2>/dev/null
  rm -rf "$W"
  mkdir -p "$W/cache" "$W/results" && cp -r src bench configs "$W/" && cp -r .practice/model "$W/target"
  [ -n "${ARMS:-}" ] && ARMS=$(realpath "$ARMS")
  printf '%s' "${EVAL_OVERRIDES:-}" > "$W/eval_overrides"  # a later call evaluates with them too
  printf '%s' "${EVAL_PARALLEL:-1}" > "$W/eval_parallel"
  PROMPTS=${PROMPTS:-.quality/turns4}
  train_prompts() {  # PROMPTS's training prompts (.jsonl or .jsonl.gz) into the folder $1
    if [ -e "$PROMPTS/train_prompts.jsonl.gz" ]; then
      gunzip -c "$PROMPTS/train_prompts.jsonl.gz" > "$1/train_prompts.jsonl"
    else cp "$PROMPTS/train_prompts.jsonl" "$1/"; fi
  }
  if ls "$PROMPTS"/quality-cache.tar.gz.part* >/dev/null 2>&1; then  # replies regenerated by an earlier call
    cat "$PROMPTS"/quality-cache.tar.gz.part* | tar xzf - -C "$W/cache"
  else train_prompts "$W/cache"; fi
  cp "$PROMPTS/eval_prompts.jsonl" "$W/cache/"
  if [ -n "${DATA2:-}" ]; then
    ls "$DATA2"/quality-cache.tar.gz.part* >/dev/null || { echo "DATA2=$DATA2 holds no quality-cache parts"; exit 1; }
    mkdir -p "$W/data2" && cat "$DATA2"/quality-cache.tar.gz.part* | tar xzf - -C "$W/data2"
  fi
  unpack_extra() {  # unpack_extra NAME: an earlier call's output of a second source (PROMPTS/NAME-cache parts)
    mkdir -p "$W/$1"
    if ls "$PROMPTS/$1"-cache.tar.gz.part* >/dev/null 2>&1; then
      cat "$PROMPTS/$1"-cache.tar.gz.part* | tar xzf - -C "$W/$1" \
        || { echo "$PROMPTS/$1-cache.tar.gz.part* do not unpack (a part missing?)"; finish; exit 1; }
    fi
  }
  if [ -n "${REGEN2:-}" ]; then unpack_extra regen2 && train_prompts "$W/regen2"; fi
  if [ -n "${SYNTH:-}" ]; then unpack_extra synth; fi
  EVAL_ARGS=()
  if [ -n "${EVAL:-}" ]; then
    rm -rf "$W/cache/eval" "$W/cache/eval.jsonl"; cp "$EVAL/eval_prompts.jsonl" "$W/cache/"
    EVAL_ARGS=("eval.num_prompts=$(wc -l < "$EVAL/eval_prompts.jsonl")")
  fi
  cd "$W" || exit 1
  export PYTHONPATH=$W/src:/tmp/site
  COMMON=(--target "$W/target" --cache "$W/cache" --sampled-replies 0)  # sampled replies: REGEN2 and the arms
  REGEN=(regenerate.batch_size=4096 "$@")
  step data 400 python3 bench/quality/quality.py "${COMMON[@]}" --data-only "${REGEN[@]}"
  python3 bench/quality/quality.py "${COMMON[@]}" --data-only --no-regen --pack "$OUT" > "$LOGS/pack.log" 2>&1
  grep -E "^data:|packed" "$LOGS/pack.log" | cut -c1-400
  if [ -n "${DATA_ONLY:-}" ]; then finish; exit 0; fi
  # A second source written within this call into $W/NAME/train (the training must start before the call ends),
  # resumed from an earlier call's parts, and packed into $OUT as NAME-cache parts for later calls.
  extra_source() {  # extra_source NAME COMMAND OVERRIDE...: `dflash-train COMMAND` with the practice recipe
    local name=$1; shift
    local left=$(( ${DEADLINE_S:-570} - (SECONDS - T0) - 30 ))
    (( left > 0 )) || { echo "no time left in this call for $name (DEADLINE_S=${DEADLINE_S:-570})"; finish; exit 1; }
    # its log is NAME-source.log: an arm may be named NAME too (bench/quality/arms/synth.txt)
    step "$name-source" "$left" python3 -m dflash_trainer "$1" --config practice --out "$W/$name/train" "${@:2}" \
      target.path="$W/target" logging.progress=false "run.device=${DEVICE:-cuda}"
    local rc=$?  # non-zero also when an earlier call's output (from PROMPTS) has other settings
    if (( rc != 0 )) || ! grep -q '"complete": true' "$W/$name/train/manifest.json" 2>/dev/null; then
      echo "$name failed or did not finish (see $name-source.log): not training on it"; finish; exit 1
    fi
    tar czf - --exclude=.lock -C "$W/$name" train | split -b 15m -d - "$OUT/$name-cache.tar.gz.part"
  }
  # shellcheck disable=SC2086  # REGEN2, SYNTH: their regenerate.* / synthesize.* overrides
  if [ -n "${REGEN2:-}" ]; then
    extra_source regen2 regenerate \
      data.path="$W/regen2/train_prompts.jsonl" data.max_conversations=null regenerate.batch_size=4096 $REGEN2
  fi
  # shellcheck disable=SC2086
  if [ -n "${SYNTH:-}" ]; then
    extra_source synth synthesize synthesize.batch_size=4096 regenerate.batch_size=4096 $SYNTH
  fi
  # its own session (it outlives this call); it writes its pid, which is also its process group's id
  if [ -n "${ARMS:-}" ]; then
    WHAT=(--arms "$ARMS" --parallel "${PARALLEL:-$(grep -cvE '^(#|[[:space:]]*$)' "$ARMS")}")
  else WHAT=(--name "$NAME"); fi
  setsid bash -c 'echo $$ > "$0/train.pid"; exec "${@:1}"' "$W" python3 bench/quality/quality.py "${COMMON[@]}" --no-regen \
    --runs "$W/runs" --results "$W/results" "${WHAT[@]}" "train.max_minutes=${MINUTES:-15}" "${EVAL_ARGS[@]}" "$@" \
    > "$W/train.log" 2>&1 < /dev/null &
  for _ in 1 2 3 4 5; do [ -s "$W/train.pid" ] && break; sleep 1; done
  echo "training ${ARMS:-$NAME} started (pid $(cat "$W/train.pid")) at $((SECONDS - T0)) s"
  follow
else
  cd "$W" || exit 1
  export PYTHONPATH=$W/src:/tmp/site
  EVAL_OVERRIDES=${EVAL_OVERRIDES:-$(cat "$W/eval_overrides" 2>/dev/null)}
  EVAL_PARALLEL=${EVAL_PARALLEL:-$(cat "$W/eval_parallel" 2>/dev/null || echo 1)}
  follow
fi
if ! kill -0 "$(cat "$W/train.pid")" 2>/dev/null; then  # the runs ended: every export left is evaluated alone
  tail -n 5 "$W/train.log"
  wait "$(cat "$W/train.pid")" 2>/dev/null  # the training job, if this call started it
  until evaluate_ended all; do sleep 2; done
fi
(( ${#EVAL_PIDS[@]} )) && wait "${EVAL_PIDS[@]}"  # each ends before the deadline (its limit)
cp "$W/train.log" "$W"/runs/*.log "$LOGS/" 2>/dev/null; cp -r "$W"/results/* "$RESULTS/" 2>/dev/null
echo "suite: $((SECONDS - T0)) s"
finish
