#!/usr/bin/env bash
# The test suite (CPU, tiny models). Arguments go to pytest: test files or -k expressions choose tests
# (`bash scripts/test.sh tests/test_resume.py -k demo`); none runs them all (pyproject's testpaths).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# One thread per process: the tests' models are tiny and many tests start several processes, so more threads only wait
# for each other (and for other work on a shared machine). OMP_NUM_THREADS set by the caller wins.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
echo "test.sh: OMP_NUM_THREADS=$OMP_NUM_THREADS (torch threads per test process)"
python -m pytest -q "$@"
