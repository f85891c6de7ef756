#!/usr/bin/env bash
# One bench script on the device machine with the carried wheels installed (carry .whl), for a run that no suite
# names: its arguments follow the script; its JSON and log come back in $OUT/results.tar.gz. LIMIT_S (default 560)
# bounds it. Any script built on bench/common.py's parser (it takes --out):
#   bash bench/run.sh bench/speed/run.py --model qwen3-8b --workload mfu --seqs 1 --seq-len 3072 --no-baseline
source "$(dirname "$0")/common.sh"
script=$1
shift
step "$(basename "$script" .py)" "${LIMIT_S:-560}" python3 "$script" "$@" --out "$RESULTS"
rc=$?
finish
exit $rc
