#!/usr/bin/env bash
# One batch of GPU work on the device machine (H200): install carried wheels, run the GPU tests and the
# benchmarks, copy every log and result JSON under $OUT. Usage: bash bench/gpu_session.sh PART
#   PART=1: GPU tests, drafter step (8B shape), target forward (8B shape), end to end 1.7B
#   PART=2: end to end 8B (mfu workload), colocated training run with a 1.7B-shape target + eval
#   PART=3: 8B with the target's layers compiled, 8B on the ShareGPT length mix, the drafter step alone
#   PART=4: GPU tests and 8B with the target compiled, against the baseline
#   PART=5: the drafter step alone (8B shape): variants side by side, with kernel profiles
#   PART=6: the drafter step: flex kernel options side by side
#   PART=8: the GPU training test, end to end 1.7B (mfu) and 8B (ShareGPT mix)
#   PART=9: the drafter step with CUDA graphs (torch.compile reduce-overhead) against without
#   PART=10: 8B on the ShareGPT mix, profiled (target forward alone, whole step)
#   PART=11: the target forward on one padded mixed-length batch: idle time under a few settings
#   PART=12 (prepared for the next session): CUDA graphs for the drafter step, measured for real; the
#           ShareGPT mix with the target's layers compiled (shape-generic after one recompile)
#   PART=13 (needs kind nvidia-h200-x8; ask `status` first): N-GPU scaling, real training runs
#   PART=15: the padded-batch accuracy check (taps vs fp32 alone, per tap), 1.7B mfu with the target compiled
#   PART=16: real training runs (1.7B shape, ShareGPT, 120 steps): the target compiled (the default, recompiles
#            logged) against eager, steady-state tokens/s from metrics.jsonl
#   PART=17: part 16's compiled run alone, after the fix that decodes eager (evaluation recompiled every layer)
#   PART=18 (needs kind nvidia-h200-x2): part 16's run split 1:1 over two GPUs (NCCL), then 2 colocated ranks
#   PART=19: tokenizing on a cache miss, one process against 2-16 worker processes (the device's 16 CPUs)
#   PART=20 (needs kind nvidia-h200-x2): N-GPU scaling at N=2 in one call (1 GPU, split 1:1, 2 colocated)
#   PART=14: padded target batches without an attention mask: GPU tests (target compiled by default), the
#            padded-batch profile with and without the mask, 8B ShareGPT mix and 8B mfu (target compiled)
#   PART=7: GPU parity test, the drafter step (masks from key intervals vs create_block_mask, profiled), 8B end to end
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-/tmp/out}
OUT=/tmp/gpu_logs  # everything is packed into one archive at the end (few files come back)
mkdir -p "$OUT" "$FINAL" bench/results
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/src:/tmp/site
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s"; tail -n 25 "$OUT/$name.log"
}
# A real training run for parts 16 and 17: 1.7B-shape target, ShareGPT (tiny tokenizer), 120 steps, eval at the end
TRAIN=(python3 -m dflash_trainer train --config demo run.device=cuda target.random_init=qwen3-1.7b
  target.dtype=bfloat16 train.dtype=bfloat16 drafter.attention=flex drafter.num_layers=5 drafter.block_size=16
  drafter.tap_layer_ids=null pipeline.token_budget=12288 data.max_length=3072 data.max_conversations=3000
  train.num_epochs=1 train.max_steps=120 train.log_interval=1 train.checkpoint_interval=100000
  logging.progress=false eval.num_prompts=4 eval.max_new_tokens=64)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
case "${1:-1}" in
  1)
    step gpu_tests 240 python3 -m pytest -q -x -m gpu tests/test_gpu.py
    step drafter_step 200 python3 bench/drafter_step.py
    step target_forward 200 python3 bench/target_forward.py --iters 3
    step run_1p7b_mfu 200 python3 bench/run.py --model qwen3-1.7b --workload mfu
    ;;
  2)
    step run_8b_mfu 330 python3 bench/run.py --model qwen3-8b --workload mfu
    step train_1p7b 150 python3 -m dflash_trainer train --config demo run.dir=/tmp/run17 run.device=cuda \
      target.random_init=qwen3-1.7b target.dtype=bfloat16 train.dtype=bfloat16 drafter.attention=flex \
      drafter.num_layers=5 drafter.block_size=16 drafter.tap_layer_ids=null pipeline.token_budget=12288 \
      data.max_length=3072 data.max_conversations=600 train.num_epochs=1 train.max_steps=20 logging.progress=false \
      eval.num_prompts=4 eval.max_new_tokens=64
    cp /tmp/run17/summary.json "$OUT/train_1p7b_summary.json" 2>/dev/null
    cp /tmp/run17/eval.json "$OUT/train_1p7b_eval.json" 2>/dev/null
    step eval_1p7b 90 python3 -m dflash_trainer eval --config /tmp/run17/config.yaml --drafter /tmp/run17/export --out /tmp/run17/eval2
    cp /tmp/run17/eval2/eval.json "$OUT/eval_1p7b.json" 2>/dev/null
    ;;
  3)
    step run_8b_mfu_ctarget 200 python3 bench/run.py --model qwen3-8b --workload mfu --compile-target --no-baseline
    step run_8b_sharegpt 220 python3 bench/run.py --model qwen3-8b --workload sharegpt
    step drafter_step_nobase 150 python3 bench/drafter_step.py --no-baseline
    ;;
  4)
    step gpu_tests 170 python3 -m pytest -q -x -m gpu tests/test_gpu.py
    step run_8b_mfu_ctarget_base 260 python3 bench/run.py --model qwen3-8b --workload mfu --compile-target
    ;;
  5)
    step drafter_ab 540 python3 bench/drafter_step.py --variant ours --variant "eager ce" --variant "chunk 4096" --profile
    cat "$OUT/drafter_ab.log" | grep -v '^{' | tail -n 120
    ;;
  6)
    K=drafter.flex_kernel_options
    step drafter_flex 560 python3 bench/drafter_step.py --steps 6 --warmup 2 --variant ours \
      --variant "prescale: $K.PRESCALE_QK=true" \
      --variant "tma: $K.USE_TMA=true" \
      --variant "nowdq: $K.WRITE_DQ=false" \
      --variant "bwd64: $K.bwd_BLOCK_M1=64 $K.bwd_BLOCK_N1=64 $K.bwd_BLOCK_M2=64 $K.bwd_BLOCK_N2=64 $K.bwd_num_warps=4 $K.bwd_num_stages=3" \
      --variant "bwdM32: $K.bwd_BLOCK_M1=32 $K.bwd_BLOCK_N1=128 $K.bwd_BLOCK_M2=128 $K.bwd_BLOCK_N2=32 $K.bwd_num_warps=8 $K.bwd_num_stages=3" \
      --variant "bwd_s2: $K.bwd_BLOCK_M1=64 $K.bwd_BLOCK_N1=128 $K.bwd_BLOCK_M2=128 $K.bwd_BLOCK_N2=64 $K.bwd_num_warps=8 $K.bwd_num_stages=2" \
      --variant "fwd128: $K.fwd_BLOCK_M=128 $K.fwd_BLOCK_N=128 $K.fwd_num_warps=8 $K.fwd_num_stages=2"
    grep -v '^{' "$OUT/drafter_flex.log" | grep -A12 "^drafter step" | tail -n 40
    ;;
  7)
    step gpu_parity 100 python3 -m pytest -q -x -m gpu tests/test_gpu.py -k flex_matches
    step drafter_masks 170 python3 bench/drafter_step.py --steps 8 --warmup 2 --variant ours --variant create_block_mask \
      --profile --profile-steps 3
    grep -v '^{' "$OUT/drafter_masks.log" | grep -B2 -A12 "kind  \|longest idle\|^drafter step" | tail -n 80
    step run_8b_mfu_ctarget_base 290 python3 bench/run.py --model qwen3-8b --workload mfu --compile-target
    ;;
  8)
    step gpu_train 110 python3 -m pytest -q -x -m gpu tests/test_gpu.py -k colocated
    step run_1p7b_mfu 130 python3 bench/run.py --model qwen3-1.7b --workload mfu
    step run_8b_sharegpt 230 python3 bench/run.py --model qwen3-8b --workload sharegpt
    ;;
  9)
    step drafter_graphs 250 python3 bench/drafter_step.py --steps 8 --warmup 3 --variant ours --variant "cuda graphs" \
      --profile --profile-steps 2
    grep -v '^{' "$OUT/drafter_graphs.log" | grep -B2 -A10 "kind  \|^drafter step\|Error\|error" | tail -n 60
    ;;
  10)
    step run_8b_sharegpt_profile 200 python3 bench/run.py --model qwen3-8b --workload sharegpt --no-baseline --profile 2
    grep -v '^{' "$OUT/run_8b_sharegpt_profile.log" | grep -A30 "kernel profile" | cut -c1-150 | tail -n 75
    ;;
  11)
    step target_padded 150 python3 bench/target_padded.py
    grep -v '^{' "$OUT/target_padded.log" | grep -A9 "kind  \|^variant" | cut -c1-150 | tail -n 50
    ;;
  12)
    step drafter_graphs 250 python3 bench/drafter_step.py --steps 8 --warmup 3 --variant ours --variant "cuda graphs"
    step run_8b_sharegpt_ctarget 300 python3 bench/run.py --model qwen3-8b --workload sharegpt --compile-target \
      --warmup 6 --profile 2
    grep -v '^{' "$OUT/run_8b_sharegpt_ctarget.log" | grep -A9 "kernel profile\|^variant" | cut -c1-150 | tail -n 40
    ;;
  13)
    export NCCL_NVLS_ENABLE=0  # no NVLink multicast (device KINDS.md)
    step scaling_8 580 python3 bench/scaling.py --gpus 8 --splits 3 --steps 30 --timeout-s 280
    ;;
  14)
    step gpu_tests 200 python3 -m pytest -q -x -m gpu tests/test_gpu.py
    step target_padded 120 python3 bench/target_padded.py
    grep -v '^{' "$OUT/target_padded.log" | grep -A6 "^taps\|^variant" | cut -c1-150 | tail -n 14
    step run_8b_sharegpt_ctarget 200 python3 bench/run.py --model qwen3-8b --workload sharegpt --compile-target --warmup 6
    step run_8b_mfu_ctarget 200 python3 bench/run.py --model qwen3-8b --workload mfu --compile-target
    ;;
  15)
    step target_padded 150 python3 bench/target_padded.py
    grep -v '^{' "$OUT/target_padded.log" | grep -A6 "^taps\|^variant" | cut -c1-150 | tail -n 14
    step run_1p7b_mfu_ctarget 150 python3 bench/run.py --model qwen3-1.7b --workload mfu --compile-target
    ;;
  16)
    TORCH_LOGS=recompiles step train_compiled 280 "${TRAIN[@]}" run.dir=/tmp/run_c
    echo "recompiles logged: $(grep -c 'Recompiling' "$OUT/train_compiled.log")"
    step train_eager 240 "${TRAIN[@]}" run.dir=/tmp/run_e target.compile=false
    step train_steady 30 python3 bench/train_steady.py /tmp/run_c /tmp/run_e --skip 40
    cp /tmp/run_c/summary.json "$OUT/train_compiled_summary.json" 2>/dev/null
    cp /tmp/run_e/summary.json "$OUT/train_eager_summary.json" 2>/dev/null
    ;;
  18)
    export NCCL_NVLS_ENABLE=0  # no NVLink multicast (device KINDS.md)
    DIST=(python3 -m torch.distributed.run --standalone --nproc_per_node 2)
    step train_split 130 "${DIST[@]}" "${TRAIN[@]:1}" run.dir=/tmp/run_s pipeline.colocated=false \
      pipeline.num_targets=1 eval.at_end=false train.max_steps=80
    grep "Error\|error\|drafter_wait\|target_idle\|bytes_moved" "$OUT/train_split.log" | tail -n 8
    step train_coloc2 110 "${DIST[@]}" "${TRAIN[@]:1}" run.dir=/tmp/run_c2 pipeline.colocated=true \
      eval.at_end=false train.max_steps=80
    step train_steady 30 python3 bench/train_steady.py /tmp/run_s /tmp/run_c2 --skip 30
    cp /tmp/run_s/summary.json "$OUT/train_split_summary.json" 2>/dev/null
    cp /tmp/run_c2/summary.json "$OUT/train_coloc2_summary.json" 2>/dev/null
    ;;
  20)
    export NCCL_NVLS_ENABLE=0  # no NVLink multicast (device KINDS.md)
    step scaling_2 580 python3 bench/scaling.py --gpus 2 --splits 1 --colocated-n --steps 30 --timeout-s 180
    ;;
  19)
    step data_prep 400 python3 bench/data_prep.py --conversations 6000 --workers 1,4,8,16
    ;;
  17)
    TORCH_LOGS=recompiles step train_compiled 280 "${TRAIN[@]}" run.dir=/tmp/run_c
    echo "recompiles logged: $(grep -c 'Recompiling' "$OUT/train_compiled.log")"
    grep "tau_eval\|elapsed_s\|checkpoint" "$OUT/train_compiled.log" | tail -n 5
    step train_steady 30 python3 bench/train_steady.py /tmp/run_c --skip 40
    cp /tmp/run_c/summary.json "$OUT/train_compiled_summary.json" 2>/dev/null
    ;;
esac
cp bench/results/*.json "$OUT/" 2>/dev/null
ls -la "$OUT"
tar czf "$FINAL/gpu_part${1:-1}.tgz" -C "$OUT" .
