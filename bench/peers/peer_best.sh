#!/usr/bin/env bash
# Issue 54 (item 3): the peer at its best beside our third seed, in one start call and wait calls on one GPU.
#   PHASE=start bash bench/peers/peer_best.sh
#       prices the peer's settings at the 8B shape (PRICES, `peer_step_8b.sh`; settings that could run past PRICE_BY_S
#       seconds are skipped), picks the cheapest per real token at the example's 512 anchors (`peer_best.py`; 80 anchors
#       when none ran), starts its cells (5 and 15 8B-minutes x both inits x seeds 0-2, `peer_cells.sh`) and ours
#       (OURS_ARMS with OURS_OVERRIDES, `curve.sh`), which share the GPU (step-bound: sharing changes no result).
#   PHASE=wait bash bench/peers/peer_best.sh      # within 30 s of the last call's end, until both have ended
# BUDGETS="5" (default "5 15") runs the 5-minute cells alone: one start call and a short wait; OURS_BUDGETS (default
# BUDGETS) sets our arms' budgets apart from the peer's (`none`: the peer's cells alone). PRICED="PRICE.json ... RUN.json"
# picks from the prices and our step of an earlier call (its results, one card) instead of pricing again. INITS
# (default "random target") the peer's inits; PRICES and FALLBACK its settings ("NAME peers.py-options" lines). The
# cells and arms that ended come back on every call, each evaluated alone as soon as it ends.
# The peer's DSpark (ModelOpt's `projector_type: dspark`) at its best against our DFlash2 bar (bench/RESULTS.md section
# 5: those arms' JSONs; `bench/peers/drafts_parity.py` checks that our evaluator drafts what ModelOpt drafts): a block
# of 15 verifies 16 tokens as our block of 16 does, and its rows must hold whole blocks (765 = 51 x 15):
#   DSPARK="--block-size 15 --peer-overrides dflash.dflash_architecture_config.projector_type=dspark \
#     dflash.dflash_architecture_config.markov_rank=256"
#   INITS=random OURS_BUDGETS=none PRICES="b8-a512-765-dspark --batch 8 --seq-len 765 $DSPARK \
#     dflash.dflash_use_torch_compile=true;b8-a80-765-dspark --batch 8 --seq-len 765 $DSPARK dflash.dflash_num_anchors=80 \
#     dflash.dflash_use_torch_compile=true" FALLBACK="b8-a80-765-dspark-eager --batch 8 --seq-len 765 $DSPARK \
#     dflash.dflash_num_anchors=80" PHASE=start bash bench/peers/peer_best.sh
# Ran 2026-12-06 on one H100 with only the 80-anchor line in PRICES, BUDGETS=5 PRICE_BY_S=260 (one call, 477 s;
# bench/RESULTS.md section 6). Next: the 15-minute cells, PRICED="<that call's price JSON> <its run JSON>" BUDGETS=15.
# The peer's Domino (`projector_type: domino`, its recipe's head: emb_dim 256, gru_hidden_dim 1024; ModelOpt's main.py
# adds its base-to-final loss curriculum by itself); a block of 16 verifies 16 tokens and drafts 15, as ours, and
# `dflash-train eval` drafts as SGLang serves it (greedy; scripts/serving_check/domino_case.py):
#   DOMINO="--peer-overrides dflash.dflash_architecture_config.projector_type=domino \
#     dflash.dflash_architecture_config.emb_dim=256 dflash.dflash_architecture_config.gru_hidden_dim=1024 \
#     dflash.dflash_architecture_config.pure_draft_prefix_len=1 dflash.dflash_architecture_config.shift_label=true"
#   INITS=random OURS_BUDGETS=none BUDGETS=5 PRICE_BY_S=260 PRICES="b8-a80-768-domino --batch 8 --seq-len 768 $DOMINO \
#     dflash.dflash_num_anchors=80 dflash.dflash_use_torch_compile=true" FALLBACK="b8-a80-768-domino-eager --batch 8 \
#     --seq-len 768 $DOMINO dflash.dflash_num_anchors=80" PHASE=start bash bench/peers/peer_best.sh
# (Its CPU smoke, 60 steps, ran 2026-12-06: bench/README.md "The peer's Domino".)
# Every export is evaluated alone with the fp32 target on the 200 held-out prompts of .quality/first200. Carry .whl
# .whl-peer .practice .peer/modelopt .quality/first200. Then `python bench/quality/compare.py --seeds 3` on the JSONs.
T0=$SECONDS
D=${DEADLINE_S:-570}
BUDGETS=${BUDGETS:-5 15}  # 8B GPU minutes per peer cell
OURS_BUDGETS=${OURS_BUDGETS:-$BUDGETS}  # ours: the arms of OURS_ARMS named ours<minutes>-...
OURS_ARMS=${OURS_ARMS:-bench/quality/arms/dpace-8b-minutes-s2.txt}
OURS_OVERRIDES=${OURS_OVERRIDES:-regenerate.max_turns=1 regenerate.max_prompt_tokens=1024 pipeline.token_budget=5461 \
eval.num_prompts=40 drafter.dpace=true data.num_workers=1}
# its draft module compiled (the example's own switch; `training.torch_compile=true`, the HF Trainer's, breaks its graph at
# the anchor sampler's `.item()`), at its 512 anchors and at 80. 512 ran out of memory at 8 and at 4 rows of 768 on an
# H100 (bench/RESULTS.md section 6): a later budget's cells keep the earlier pick with PRICES="<that line>".
PRICES=${PRICES:-b8-a512-768-dcompile --batch 8 --seq-len 768 --peer-overrides dflash.dflash_use_torch_compile=true;\
b8-a80-768-dcompile --batch 8 --seq-len 768 --peer-overrides dflash.dflash_num_anchors=80 dflash.dflash_use_torch_compile=true}
FALLBACK=${FALLBACK:-b8-a80-768 --batch 8 --seq-len 768 --peer-overrides dflash.dflash_num_anchors=80}  # uncompiled
source "$(dirname "$0")/../common.sh"  # the carried wheels, $LOGS, $RESULTS and `finish`
export EVAL_OVERRIDES=target.dtype=float32 EVAL_PARALLEL=${EVAL_PARALLEL:-16}
if [ "${PHASE:-start}" = start ]; then
  P=/tmp/peer-best; rm -rf "$P"; mkdir -p "$P"
  price() {  # price SETTINGS BY_S: peer_step_8b.sh into $P/price (its own logs and results), none past BY_S
    SUITE_TMP=$P/price OUT=$P/price-out OURS= STEPS=${STEPS:-16} PEER_S=${PEER_S:-200} PEER_CELLS="$1" \
      DEADLINE_S=$(( $2 - (SECONDS - T0) )) bash bench/peers/peer_step_8b.sh
  }
  mkdir -p "$P/ours" "$P/price/suite-results"
  if [ -n "${PRICED:-}" ]; then  # an earlier call's prices and our step, both from one card
    for f in $PRICED; do case $f in *-run-*) cp "$f" "$P/ours/" ;; *) cp "$f" "$P/price/suite-results/" ;; esac; done
  else
    price "$PRICES" "${PRICE_BY_S:-300}"
    # our step on this card when it is not an H200 (the card that priced our cells' steps): the peer's budget follows
    # the ratio
    if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      timeout 150 python3 bench/speed/run.py --model qwen3-8b --workload mfu --seqs 2 --seq-len 2731 --blocks-per-seq 455 \
        --no-baseline --compile-target --warmup 6 --steps 10 --out "$P/ours" > "$P/ours.log" 2>&1
      tail -n 4 "$P/ours.log"
    fi
  fi
  OURS_JSON=$(ls "$P"/ours/*run-qwen3-8b*.json 2>/dev/null | head -n 1)
  # shellcheck disable=SC2086  # BUDGETS: a list
  pick() { python3 bench/peers/peer_best.py "$P"/price/suite-results/*.json --cells "$P/cells.txt" \
    ${OURS_JSON:+--ours "$OURS_JSON"} --minutes $BUDGETS --inits ${INITS:-random target} --results "$P/price/suite-results"; }
  keep_prices() {  # the prices (failed ones too) and our step into the results that come back
    cp "$P"/price/suite-results/* "$P"/ours/* "$RESULTS/" 2>/dev/null
    cp "$P"/price/suite-logs/* "$P/ours.log" "$LOGS/" 2>/dev/null
    finish
  }
  pick; rc=$?
  if (( rc == 3 )) && [ -z "${PRICED:-}" ]; then  # no setting ran: price 80 anchors (250 s: its random target is made again)
    price "$FALLBACK" $(( SECONDS - T0 + ${PEER_S:-200} + 250 )); pick || { keep_prices; exit 1; }
  elif (( rc != 0 )); then keep_prices; exit 1; fi
  keep_prices
  rm -rf /tmp/peer8b  # the random 8B checkpoint (16 GB of disk)
  PHASE=start CELLS=$P/cells.txt PROMPTS=.quality/first200 DEADLINE_S=0 bash bench/peers/peer_cells.sh
  if [ "$OURS_BUDGETS" = none ]; then  # the peer's cells alone (ours evaluated in an earlier call)
    PHASE=wait DEADLINE_S=$(( D - (SECONDS - T0) )) bash bench/peers/peer_cells.sh
    exit
  fi
  for m in $OURS_BUDGETS; do grep -E "^ours${m}-" "$OURS_ARMS"; done > "$P/ours-arms.txt"  # our arms of these budgets
  # shellcheck disable=SC2086  # OURS_OVERRIDES: separate overrides
  PHASE=start MINUTES=120 ARMS=$P/ours-arms.txt PROMPTS=.quality/first200 EVAL=.quality/first200 \
    DEADLINE_S=$(( D - (SECONDS - T0) )) bash bench/quality/curve.sh $OURS_OVERRIDES
else
  [ -e /tmp/curve/train.pid ] && PHASE=wait DEADLINE_S=$D bash bench/quality/curve.sh  # our arms, when they ran
  PHASE=wait DEADLINE_S=$(( D - (SECONDS - T0) )) bash bench/peers/peer_cells.sh
fi
