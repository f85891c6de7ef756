#!/usr/bin/env bash
# Where the device machine's host time goes (issue 22: decoding and tokenization run many times slower there
# than on the 2-CPU development machine): the CPU quota, a pure-Python loop, import times, tokenizing in one
# process against 16, and the decode step at torch's thread count against one thread, with a Python profile.
#   bash bench/host/host.sh            (carry .whl with omegaconf and datasets, .practice/model, and .quality
#                                          with the data cache part quality-cache.tar.gz.part00)
source "$(dirname "$0")/../common.sh"
echo "nproc $(nproc); affinity $(python3 -c 'import os; print(len(os.sched_getaffinity(0)))'); cpu.max $(cat /sys/fs/cgroup/cpu.max 2>/dev/null)"
grep -m1 "model name" /proc/cpuinfo; cat /sys/fs/cgroup/cpu.stat 2>/dev/null | tr '\n' ' '; echo
python3 - <<'PY'
import time
t = time.perf_counter(); s = 0
for i in range(10_000_000):
    s += i
print(f"pure-Python loop of 1e7: {time.perf_counter() - t:.2f} s")
PY
for m in torch transformers; do
  /usr/bin/time -f "import $m: %e s" python3 -c "import $m" 2>&1 | tail -1
done
D=(python3 bench/host/decode_speed.py --target .practice/model --rows 256,1024 --prompt 128 --new 32 --repeat 2)
step decode-expandable 150 "${D[@]}" --profile
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False step decode-plain-allocator 120 "${D[@]}" --pyprofile
step decode-threads-1 120 "${D[@]}" --threads 1
# tokenizing the practice target's regenerated replies (the data cache carried in .quality)
mkdir -p /tmp/qc && cat .quality/quality-cache.tar.gz.part* | tar xzf - -C /tmp/qc && cat /tmp/qc/train/shard_*.jsonl > /tmp/qc.jsonl
step data-prep 300 python3 bench/host/data_prep.py --conversations 20000 --workers 1,16 data.path=/tmp/qc.jsonl \
  target.path=.practice/model target.random_init=null target.tokenizer=null
cat /sys/fs/cgroup/cpu.stat 2>/dev/null | tr '\n' ' '; echo
finish
