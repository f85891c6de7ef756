#!/usr/bin/env bash
# Targets past the 8B bf16 shape on one GPU: FP8 targets (issue 24), MoE and gpt-oss shapes, a TP=2 target group.
# Carry .whl (torchao for FP8). PARTS picks what runs, in order (default "tests 8b";
# the 70B part alone nearly fills a call: PARTS=70b in a call of its own):
#   tests  the GPU tests of target.quantize=fp8
#   8b     the Qwen3-8B-shape tap-capture forward in bf16 and FP8 in the same run (eager and compiled layers)
#   8b-cdt the same with the layers compiled with coordinate-descent autotuning (whether the target's compile
#          should ask for it when quantized: torchao's process-wide setting, now off, gave it to FP8 targets)
#   e2e    bench/speed/run.py's training step (target forward + drafter step on one GPU) at the Qwen3-8B shape with
#          a bf16 target, then an FP8 one (no naive baseline): what FP8 gives a whole step
#   70b    whether a Llama-3-70B-shape FP8 target fits on one H200: eager first, then with compiled layers
#   practice  40 steps of configs/practice.yaml on the practice target's FP8 taps, then on its bf16 taps, every
#          step logged: whether a run on FP8 taps starts as fast as one on bf16 taps (bench/RESULTS.md, "FP8 taps
#          against bf16 taps": torchao's process-wide autotuning once stalled it). Recompilations are logged
#          (TORCH_LOGS=recompiles); a run still going after 150 s dumps every thread's stack (SIGABRT,
#          faulthandler) into its log. Also carry .practice/model and .quality/turns4 (the data cache parts).
#   practice-eval  a drafter of 500 steps of configs/practice.yaml (bf16 taps), evaluated on the FP8 target and on
#          the bf16 one over .quality/eval200 (carry its eval_prompts.jsonl too): whether the FP8 target decodes
#          left-padded prompts (every prompt's reply, not its first token only) and how close its tau is
#   moe      the Qwen3-30B-A3B shape (MFU by active experts) with a kernel profile of the capture forward
#   moe-experts  one compiled MoE layer's experts: transformers' grouped_mm combine against two others
#   tp-shared  a TP=2 target group with both ranks on one GPU (gloo): its taps against TP=1, compiled, then eager
#   gpt-oss  the gpt-oss-20b shape (flex attention with sinks, sliding layers), eager and compiled layers
source "$(dirname "$0")/../common.sh"
practice_steps() {  # practice_steps NAME OVERRIDES...: 40 logged steps of the practice recipe, no final eval
  local name=$1; shift
  # a cold compile cache of its own each, so neither run inherits the other's compiled drafter
  step "$name" 170 env PYTHONFAULTHANDLER=1 TORCH_LOGS=recompiles \
    TORCHINDUCTOR_CACHE_DIR="/tmp/practice-runs/inductor-$name" \
    timeout -s ABRT 150 python3 -m dflash_trainer train "${PRACTICE[@]}" run.dir="/tmp/practice-runs/$name" \
    train.max_steps=40 train.max_minutes=null train.log_interval=1 eval.at_end=false logging.report=false \
    logging.progress=false run.device=cuda "$@"
}
for part in ${PARTS:-tests 8b}; do
  case $part in
    tests) step gpu-tests 120 python3 -m pytest -q -x tests/test_target_quantize.py ;;
    8b) step fp8-8b 240 python3 bench/target/target_forward.py --quantize none,fp8 --budgets 16384 --iters 3 ;;
    8b-cdt) step fp8-8b-cdt 330 python3 bench/target/target_forward.py --quantize none,fp8 --budgets 16384 --iters 3 \
           --coordinate-descent ;;
    e2e) for quantize in none fp8; do
           step "run-8b-$quantize" 200 python3 bench/speed/run.py --model qwen3-8b --workload mfu --no-baseline \
             --quantize $quantize --out "$RESULTS"
         done ;;
    70b) step fp8-70b-eager 200 python3 bench/target/target_forward.py --preset llama3-70b --quantize fp8 --budgets 8192 \
           --iters 2 --no-compile
         step fp8-70b 330 python3 bench/target/target_forward.py --preset llama3-70b --quantize fp8 --budgets 8192 --iters 2 ;;
    practice) practice_data || { finish; exit 1; }  # tokenized once, before both runs
         ulimit -c 0  # an aborted CUDA process must not write a core file
         practice_steps practice-fp8 target.quantize=fp8
         practice_steps practice-bf16 ;;
    practice-eval) practice_data || { finish; exit 1; }
         run=/tmp/practice-runs/eval-source
         step practice-eval-train 200 python3 -m dflash_trainer train "${PRACTICE[@]}" run.dir=$run \
           train.max_steps=500 train.max_minutes=null eval.at_end=false logging.report=false logging.progress=false \
           run.device=cuda || continue  # no export to evaluate
         for quantize in fp8 null; do
           step "practice-eval-$quantize" 150 python3 -m dflash_trainer eval --drafter $run/export \
             --out "$RESULTS/practice-eval-target-$quantize" eval.prompts="$PWD/.quality/eval200/eval_prompts.jsonl" \
             eval.num_prompts=200 eval.max_new_tokens=128 run.device=cuda target.quantize=$quantize
         done ;;
    moe) step target_forward_moe 400 python3 bench/target/target_forward.py --preset qwen3-30b-a3b --budgets 16384 \
           --iters 3 --profile ;;
    moe-experts) step moe_experts 150 python3 bench/large_targets/moe_experts.py ;;
    gpt-oss) step target_forward_gpt_oss 300 python3 bench/target/target_forward.py --preset gpt-oss-20b --budgets 16384 \
           --iters 3 ;;
    tp-shared) step target_parallel 250 python3 bench/large_targets/target_parallel.py
           step target_parallel_eager 250 python3 bench/large_targets/target_parallel.py --eager ;;
    *) echo "unknown part $part (tests 8b 8b-cdt e2e 70b practice practice-eval moe moe-experts gpt-oss tp-shared)"; exit 2 ;;
  esac
done
finish
