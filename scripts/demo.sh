#!/usr/bin/env bash
# The demo: a tiny random-weight target, bundled ShareGPT prompts, CPU, a few minutes.
#  1. regenerate: the target answers the prompts (runs/demo-data; a rerun resumes or does nothing)
#  2. train: a drafter on the target's own answers, then export and measure real tau on held-out prompts
# Extra args are dotted config overrides for the training run (e.g. train.num_epochs=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
DATA=runs/demo-data
dflash-train regenerate --config demo --out "$DATA" logging.progress=false
RECIPE=(--config demo)
for arg in "$@"; do [ "$arg" = --resume ] && RECIPE=(); done  # a resume continues the run's own config.yaml
dflash-train train "${RECIPE[@]}" data.path="$DATA" logging.progress=false "$@"
