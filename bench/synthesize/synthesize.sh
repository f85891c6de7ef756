#!/usr/bin/env bash
# Issue 39 on one H200: the practice target writes N user prompts (`dflash-train synthesize`, prompts only), timed;
# then their diversity against the ShareGPT training prompts (bench/synthesize/synthesize_diversity.py).
#   [N=16000] [SYNTH_S=120] bash bench/synthesize/synthesize.sh [synthesize.k=v ...]
# Carry .whl, .practice/model and .quality/first200 (its train_prompts.jsonl.gz; PROMPTS= names another folder).
# Brings back results.tar.gz and the prompts (synth.tar.gz).
source "$(dirname "$0")/../common.sh"
W=/tmp/synth; rm -rf "$W"; mkdir -p "$W"
gunzip -c "${PROMPTS:-.quality/first200}"/train_prompts.jsonl.gz > "$W/sharegpt_train.jsonl"
step synthesize "${SYNTH_S:-120}" python3 -m dflash_trainer synthesize --config practice --out "$W/out" \
  target.path="$PWD/.practice/model" run.device=cuda logging.progress=false synthesize.num_prompts="${N:-16000}" \
  synthesize.answer=false synthesize.batch_size=4096 "$@"
grep -h "conversations/s\|kept of" "$LOGS/synthesize.log" | tail -n 3
cp "$W/out/manifest.json" "$RESULTS/synthesize-manifest.json" 2>/dev/null
step diversity 120 python3 bench/synthesize/synthesize_diversity.py "$W/out" "$W/sharegpt_train.jsonl" --out "$RESULTS"
tar czf "$OUT/synth.tar.gz" -C "$W" out
finish
