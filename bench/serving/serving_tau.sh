#!/usr/bin/env bash
# Issue 53 item 7: mean acceptance length of a drafter served by vLLM and by SGLang on one GPU, against
# `dflash-train eval` on the same held-out prompts, greedy (bench/serving/serving_tau.py). Written before a device machine
# with the engines was lent: not run yet.
#   [DRAFTER=EXPORT [SPEC_DRAFTER=EXPORT]] [MINUTES=3] [PROMPTS=JSONL] [NUM_PROMPTS=40]
#   [VLLM_PYTHON=PY] [SGLANG_PYTHON=PY] bash bench/serving/serving_tau.sh
# The engines: interpreters that import vllm (0.33.0) and sglang (0.5.23), each in its own environment (their torch
# pins differ; the device machine reaches no registry, so they are there already); a missing one's rows are left
# out. Without DRAFTER the suite trains the practice recipe for MINUTES on the practice target's data and serves its
# final export in both formats (carry .whl .practice .quality/turns4). PROMPTS: held-out prompts, by default
# .quality/eval200/eval_prompts.jsonl (carry it; bench/README.md says how to make it).
source "$(dirname "$0")/../common.sh"
VLLM_PYTHON=${VLLM_PYTHON:-python3}
SGLANG_PYTHON=${SGLANG_PYTHON:-python3}
PROMPTS=${PROMPTS:-.quality/eval200/eval_prompts.jsonl}
[ -f "$PROMPTS" ] || { echo "no held-out prompts at $PROMPTS: carry .quality/eval200 or set PROMPTS"; finish; exit 1; }
engines=()
for engine in vllm sglang; do
  python=$VLLM_PYTHON; [ "$engine" = sglang ] && python=$SGLANG_PYTHON
  if "$python" -c "import $engine" 2>/dev/null; then engines+=("$engine")
  else echo "$python has no $engine: no rows for it"; fi
done
[ ${#engines[@]} -gt 0 ] || { echo "neither engine imports: set VLLM_PYTHON / SGLANG_PYTHON"; finish; exit 1; }
if [ -z "${DRAFTER:-}" ]; then
  practice_data || { finish; exit 1; }
  run=/tmp/practice-runs/serving
  step train $(( ${MINUTES:-3} * 60 + 240 )) python3 -m dflash_trainer train "${PRACTICE[@]}" run.dir="$run" \
    train.max_minutes="${MINUTES:-3}" eval.at_end=false logging.report=false logging.progress=false run.device=cuda \
    || { finish; exit 1; }
  last=$(ls -d "$run"/checkpoints/step_* | sort -V | tail -n 1)
  step export-speculators 120 python3 -m dflash_trainer export --checkpoint "$last" --out /tmp/serving-export-spec \
    --format speculators --verifier "$PWD/.practice/model"
  DRAFTER=$run/export SPEC_DRAFTER=/tmp/serving-export-spec
fi
step serving-tau 540 python3 bench/serving/serving_tau.py --config configs/practice.yaml --drafter "$DRAFTER" \
  ${SPEC_DRAFTER:+--speculators-drafter "$SPEC_DRAFTER"} --prompts "$PROMPTS" --num-prompts "${NUM_PROMPTS:-40}" \
  --engines "$(IFS=,; echo "${engines[*]}")" --vllm-python "$VLLM_PYTHON" --sglang-python "$SGLANG_PYTHON" \
  --out "$RESULTS" target.path="$PWD/.practice/model"
rc=$?
finish
exit $rc
