#!/usr/bin/env bash
# The test suite (CPU, tiny models). Arguments go to pytest: test files or -k expressions choose tests
# (`bash scripts/test.sh tests/test_resume.py -k demo`); none runs them all (pyproject's testpaths).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
python -m pytest -q "$@"
