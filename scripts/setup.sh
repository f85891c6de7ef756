#!/usr/bin/env bash
# Create .venv (once) with the CPU build of torch and the project installed in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.dflash-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # The CPU build first: an unpinned torch would pull a multi-GB CUDA build.
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[test]"
  # The reference DFlash package, for the export compatibility tests (its pins are not ours: no deps).
  python -m pip install -q --no-deps "dflash==0.1.0"
  # The speculators package, for its loader's test of our speculators export: its pins exclude our transformers and
  # datasets, so it goes in without them, with the modules it imports.
  python -m pip install -q --no-deps "speculators==0.9.0" "hs-connectors==0.9.0" "loguru==0.7.3"
  python -m pip install -q "openai>=1.50"
  touch "$stamp"
fi
