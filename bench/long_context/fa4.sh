#!/usr/bin/env bash
# Issue 38: flex attention's flash-attention backend (FlashAttention-4, `drafter.flex_kernel_options.BACKEND=FLASH`)
# against its Triton kernels, on the drafter step alone at long context (bench/long_context/flex_options.sh). The image
# lacks FA4, and its wheels (bench/long_context/fa4_wheels.sh) need two calls' carry, so two calls back to back on one warm
# machine (it is released 30 s after a call, and its /tmp with it):
#   PART=1 bash bench/long_context/fa4.sh                 # carry .fa4/1 only: stashes the first part in /tmp/fa4
#   PART=2 [LEN=32768] [VARIANTS=...] [E2E=131072] bash bench/long_context/fa4.sh   # carry .fa4/2 only: joins, installs,
#                                                                                 # checks, runs
# PART=2 first checks that the backend runs the drafter's training mask and agrees with the Triton kernel and with
# fp32 (bench/long_context/fa4_check.py: output and gradients), then runs flex_options.sh with VARIANTS (default: ours, and ours
# with BACKEND=FLASH); with E2E set, the whole step at that length with the flash backend instead
# (long_context.sh, the target compiled), to set beside the Triton kernel's figure in bench/RESULTS.md.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
STASH=/tmp/fa4
case "${PART:?PART=1 or PART=2}" in
  1)
    mkdir -p "$STASH" && cp .fa4/1/* "$STASH"/ && ls -la "$STASH" ;;
  2)
    ls "$STASH"/wheels.tar.part00 >/dev/null || { echo "no first part in $STASH: run PART=1 just before, on the same machine"; exit 1; }
    cat "$STASH"/wheels.tar.part00 .fa4/2/wheels.tar.part* | tar xf - -C "$STASH" || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$STASH"/*.whl || exit 1
    # CuTeDSL's `cutlass` sits in a folder that its .pth file adds, and --target folders' .pth files are not read
    export PYTHONPATH=$PWD/src:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
    mkdir -p "${SUITE_TMP:-/tmp}/suite-results"  # the suites below pack its JSON with theirs
    python3 bench/long_context/fa4_check.py --out "${SUITE_TMP:-/tmp}/suite-results" > "$STASH/check.log" 2>&1
    CHECK=$?
    tail -c 3000 "$STASH/check.log"
    [ $CHECK = 0 ] || { echo "the flash backend failed its check (above)"; exit 1; }
    K=drafter.flex_kernel_options
    if [ -n "${E2E:-}" ]; then
      E2E_FLAGS="--set $K.BACKEND=FLASH" BASELINE= LENGTHS= bash bench/long_context/long_context.sh
    else
      VARIANTS=${VARIANTS:-"ours|flash: $K.BACKEND=FLASH"} bash bench/long_context/flex_options.sh
    fi ;;
esac
# the check again, after the suite's long output
if [ "$PART" = 2 ]; then tail -n 15 "$STASH/check.log"; fi
