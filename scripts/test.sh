#!/usr/bin/env bash
# The test suite (CPU, tiny models). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
python -m pytest -q "$@" tests
