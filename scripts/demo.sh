#!/usr/bin/env bash
# The demo: tiny random target, bundled ShareGPT data, CPU. Extra args are dotted config overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
dflash-train plan --config demo "$@"
