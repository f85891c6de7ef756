#!/usr/bin/env bash
# FP8 targets on one GPU (issue 24). Carry .whl (torchao). PARTS picks what runs, in order (default "tests 8b";
# the 70B part alone nearly fills a call: PARTS=70b in a call of its own):
#   tests  the GPU tests of target.quantize=fp8
#   8b     the Qwen3-8B-shape tap-capture forward in bf16 and FP8 in the same run (eager and compiled layers)
#   70b    whether a Llama-3-70B-shape FP8 target fits on one H200: eager first, then with compiled layers
source "$(dirname "$0")/common.sh"
for part in ${PARTS:-tests 8b}; do
  case $part in
    tests) step gpu-tests 120 python3 -m pytest -q -x tests/test_target_quantize.py ;;
    8b) step fp8-8b 240 python3 bench/target_forward.py --quantize none,fp8 --budgets 16384 --iters 3 ;;
    70b) step fp8-70b-eager 200 python3 bench/target_forward.py --preset llama3-70b --quantize fp8 --budgets 8192 \
           --iters 2 --no-compile
         step fp8-70b 330 python3 bench/target_forward.py --preset llama3-70b --quantize fp8 --budgets 8192 --iters 2 ;;
    *) echo "unknown part $part (tests, 8b, 70b)"; exit 2 ;;
  esac
done
finish
