#!/usr/bin/env bash
# Peer bake-off on the device machine (one H200): our recipe and ModelOpt's DFlash example on the same
# regenerated data, the same budget, one after the other, each alone on the GPU (bench/peers/peers.py):
#   [MINUTES=5] [PARTS="data peer ours"] [REGEN_S=170] [CALIBRATE_S=40] [TARGET=DIR] bash bench/peers/peers.sh
#       [our overrides ...]
# Carry .whl (omegaconf, and for the peer nvidia-modelopt 0.47 with pydantic, pulp, datasets; bench/README.md),
# .practice/model, .peer/modelopt (ModelOpt's examples/speculative_decoding) and .quality: either prompts/ (the
# prompt files, `python bench/quality/quality.py --prompts-only --prompt-turns 1 --cache .quality/prompts`) or the parts
# of a data cache that an earlier call brought back (quality-cache.tar.gz.part*). Writes under $OUT: the data
# cache parts (when PARTS has data) and results.tar.gz (result JSONs and logs).
T0=$SECONDS
source "$(dirname "$0")/../common.sh"
MINUTES=${MINUTES:-5}; PARTS=${PARTS:-"data peer ours"}
W=/tmp/peers; CACHE=$W/cache; mkdir -p "$CACHE" "$RESULTS"
COMMON=(--target "${TARGET:-.practice/model}" --cache "$CACHE")
QUALITY=(python3 bench/quality/quality.py "${COMMON[@]}" --sampled-replies 0)  # ours on the greedy data the peer reads
has() { [[ " $PARTS " == *" $1 "* ]]; }
if ls .quality/quality-cache.tar.gz.part* >/dev/null 2>&1; then
  "${QUALITY[@]}" --unpack .quality --data-only --no-regen > "$LOGS/unpack.log" 2>&1
else
  cp .quality/prompts/train_prompts.jsonl .quality/prompts/eval_prompts.jsonl "$CACHE/"
fi
if has data; then
  step data "${REGEN_S:-170}" "${QUALITY[@]}" --data-only regenerate.batch_size=4096 \
    regenerate.max_turns=1 regenerate.max_prompt_tokens=1024
  "${QUALITY[@]}" --data-only --no-regen --pack "$OUT" > "$LOGS/pack.log" 2>&1
  grep -E "^data:|packed" "$LOGS/pack.log" | cut -c1-300
fi
if has peer; then
  step peer $(( ${MINUTES%.*} * 60 + 240 )) python3 bench/peers/peers.py modelopt "${COMMON[@]}" --work "$W/modelopt" \
    --minutes "$MINUTES" --calibrate-s "${CALIBRATE_S:-40}" --results "$RESULTS"
fi
if has ours; then
  step ours $(( ${MINUTES%.*} * 60 + 240 )) "${QUALITY[@]}" --no-regen --runs "$W/runs" \
    --results "$RESULTS" --name "ours-${MINUTES}min" "train.max_minutes=$MINUTES" "$@"
fi
python3 bench/peers/peers.py table "$RESULTS"/*.json 2>/dev/null
echo "suite: $((SECONDS - T0)) s"
finish
