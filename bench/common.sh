# Sourced by every suite: install the carried wheels, set the environment, and `step NAME LIMIT_S CMD...`,
# which runs CMD with a time limit, logs it to $LOGS/NAME.log and prints its tail. A suite ends with
# `finish`: the logs and result JSONs go into $OUT/results.tar.gz (a device call brings back few files).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/out}
SUITE_TMP=${SUITE_TMP:-/tmp}  # where the logs and result JSONs gather before `finish` packs them
LOGS=$SUITE_TMP/suite-logs
RESULTS=$SUITE_TMP/suite-results
mkdir -p "$OUT" "$LOGS" "$RESULTS"
# .whl-sharegpt (the ShareGPT file, 27 MB): carried only where a script loads ShareGPT itself (--workload sharegpt)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl $(ls .whl-sharegpt/*.whl 2>/dev/null) \
  >/dev/null 2>&1
export PYTHONPATH=$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export NCCL_NVLS_ENABLE=0  # no NVLink multicast on the device machines (device KINDS.md)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$LOGS/gpu.txt" 2>&1

step() {  # step NAME LIMIT_S CMD...; returns CMD's exit status
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s"; tail -n 25 "$LOGS/$name.log"
  return $rc
}

finish() {
  tar czf "$OUT/results.tar.gz" -C "$SUITE_TMP" suite-logs suite-results 2>/dev/null
  ls -la "$OUT"
}

# The practice target on its multi-turn data (carry .practice/model and .quality/turns4): `practice_data` unpacks
# the data cache and tokenizes it once (`dflash-train plan`), so runs after it read the tokenized cache; their run
# dirs go under /tmp/practice-runs (emptied here: a warm machine keeps an earlier call's).
PRACTICE=(--config practice target.path="$PWD/.practice/model" data.path=/tmp/practice-data/train)
practice_data() {
  rm -rf /tmp/practice-data /tmp/practice-runs && mkdir -p /tmp/practice-data /tmp/practice-runs
  cat .quality/turns4/quality-cache.tar.gz.part* | tar xzf - -C /tmp/practice-data \
    || { echo "carry .quality/turns4 (its quality-cache parts)"; return 1; }
  step practice-data 150 python3 -m dflash_trainer plan "${PRACTICE[@]}"
}

# A real training run: 1.7B-shape random target, ShareGPT lengths (tiny tokenizer), 120 steps, eval at the end.
TRAIN=(python3 -m dflash_trainer train --config demo run.device=cuda target.random_init=qwen3-1.7b
  target.dtype=bfloat16 train.dtype=bfloat16 drafter.attention=flex drafter.num_layers=5 drafter.block_size=16
  drafter.tap_layer_ids=null pipeline.token_budget=12288 data.max_length=3072 data.max_conversations=3000
  train.num_epochs=1 train.max_steps=120 train.log_interval=1 train.checkpoint_interval=100000
  logging.progress=false logging.report=false eval.num_prompts=4 eval.max_new_tokens=64)

# The peer's packages (carry .whl-peer: transformers < 5.15 with its hub and tokenizers, bench/README.md) on its
# own process path: `peer_env DIR` installs them under DIR/peer-site and writes DIR/peer-python, which runs
# python3 with them first, then checks that the peer imports.
peer_env() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$1/peer-site" .whl-peer/*.whl >/dev/null 2>&1 \
    || { echo "carry .whl-peer (bench/README.md)"; return 1; }
  printf '#!/bin/bash\nPYTHONPATH=%s:$PYTHONPATH exec python3 "$@"\n' "$1/peer-site" > "$1/peer-python"
  chmod +x "$1/peer-python"
  "$1/peer-python" -c "import transformers, modelopt; print('peer: transformers', transformers.__version__, 'modelopt', modelopt.__version__)" \
    || { echo "the peer's packages do not import (above)"; return 1; }
}
