#!/usr/bin/env bash
# Speed on one GPU: the GPU tests, then ours against the naive baseline at the 1.7B and 8B shapes (fixed rows
# and the ShareGPT length mix), and the drafter step alone. ~9 minutes on an H200.
source "$(dirname "$0")/common.sh"
step gpu_tests 200 python3 -m pytest -q -x -m gpu tests/test_gpu.py
step run_1p7b_mfu 130 python3 bench/run.py --model qwen3-1.7b --workload mfu --out "$RESULTS"
step run_8b_mfu 200 python3 bench/run.py --model qwen3-8b --workload mfu --out "$RESULTS"
step run_8b_sharegpt 200 python3 bench/run.py --model qwen3-8b --workload sharegpt --out "$RESULTS"
finish
