#!/usr/bin/env bash
# The tokenizer worker pool against one process on the device host (bench/RESULTS.md, "Host time on the device
# machine": the workers used to start one after another), each part timed on its own, so a stall shows where:
#   bash bench/host/tokenize_pool.sh     (carry .whl, .practice/model and PROMPTS's quality-cache.tar.gz.part*;
#                                          PROMPTS defaults to .quality/first200, as bench/quality/curve.sh makes it)
# 1. CPU-bound Python in K processes at once (bench/host/cpu_scaling.py): the host's own scaling.
# 2. K processes importing torch and transformers at once: a spawned worker's start-up.
# 3. bench/host/data_prep.py at one worker count a step (against one process, on the practice target's replies), with
#    the pool's log (its first chunk's wait is the workers' start-up); a step still going at its limit dumps every
#    thread's stack (SIGABRT, faulthandler) into its log. About 4 minutes.
source "$(dirname "$0")/../common.sh"
step cpu-scaling 60 python3 bench/host/cpu_scaling.py --loops 20000000
for k in 1 4 16; do  # spawned workers import these before their first chunk
  t0=$(date +%s.%N)
  for _ in $(seq "$k"); do python3 -c "import torch, transformers" & done
  wait
  echo "import torch, transformers in $k processes at once: $(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')") s"
done
CACHE=${PROMPTS:-.quality/first200}
mkdir -p /tmp/qc && cat "$CACHE"/quality-cache.tar.gz.part* | tar xzf - -C /tmp/qc \
  && cat /tmp/qc/train/shard_*.jsonl > /tmp/qc.jsonl || { echo "carry $CACHE/quality-cache.tar.gz.part*"; exit 1; }
for w in ${WORKERS:-2 4 16}; do
  step "data-prep-$w" 75 env PYTHONFAULTHANDLER=1 timeout -s ABRT 60 python3 bench/host/data_prep.py \
    --conversations "${CONVERSATIONS:-3000}" --workers "$w" data.path=/tmp/qc.jsonl target.path=.practice/model \
    target.random_init=null target.tokenizer=null --out "$RESULTS"
done
finish
