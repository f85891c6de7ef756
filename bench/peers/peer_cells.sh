#!/usr/bin/env bash
# The peer's cells at equal steps (issue 36): ModelOpt's DFlash example (bench/peers/peers.py) trained for exactly STEPS
# steps per cell, the cells of CELLS (one `NAME peers.py-option ...` a line, bench/peers/cells/modelopt.txt) sharing
# the GPU (step-bound: sharing changes no result, only the wall time), each export evaluated by `dflash-train eval`
# on PROMPTS's held-out prompts with EVAL_OVERRIDES (default target.dtype=float32, as the arms it is compared with).
# The cells run in their own process session, so they outlive the call that starts them:
#   PHASE=start CELLS="bench/peers/cells/modelopt.txt [more files]" [STEPS=1875] [PROMPTS=.quality/first200] bash bench/peers/peer_cells.sh
#   PHASE=wait bash bench/peers/peer_cells.sh      # follows them to the end and brings back results.tar.gz
# Carry .whl (ours and the peer's wheels, bench/README.md), .whl-peer (transformers < 5.15 with its hub and
# tokenizers: the peer's supported versions, on the peer's process path alone), .practice, .peer and PROMPTS
# (a data cache's quality-cache.tar.gz.part*, from curve.sh or peers.sh). EVAL_PROMPTS=N evaluates on the first N;
# PEER_ARGS="..." go to every cell (a CPU check: PEER_ARGS="--cpu --batch 2 --seq-len 256" STEPS=2 EVAL_PROMPTS=2).
T0=$SECONDS
source "$(dirname "$0")/../common.sh"
W=/tmp/cells
follow() {
  while [ -e "$W/cells.pid" ] && kill -0 "$(cat "$W/cells.pid")" 2>/dev/null && (( SECONDS - T0 < ${DEADLINE_S:-560} )); do
    sleep 30
    for log in "$W"/work/*/timed.log; do
      [ -e "$log" ] && echo "[$((SECONDS - T0)) s] $(basename "$(dirname "$log")"): $(grep -c "'loss'" "$log") losses logged"
    done
  done
}
if [ "${PHASE:-start}" = start ]; then
  [ -e "$W/cells.pid" ] && kill -- -"$(cat "$W/cells.pid")" 2>/dev/null
  rm -rf "$W" && mkdir -p "$W/cache" "$W/work" "$W/results"
  PROMPTS=${PROMPTS:-.quality/first200}
  cat "$PROMPTS"/quality-cache.tar.gz.part* | tar xzf - -C "$W/cache" || { echo "no data cache in $PROMPTS"; exit 1; }
  peer_env "$W" || { echo "nothing trained"; finish; exit 1; }
  # CELLS: one cells file or several (space-separated), run as one list
  for f in ${CELLS:?CELLS=bench/peers/cells/... expected}; do cat "$f" || exit 1; echo; done > "$W/cells.txt"
  CELLS=$W/cells.txt
  EVAL_N=${EVAL_PROMPTS:-$(wc -l < "$W/cache/eval.jsonl")}
  # shellcheck disable=SC2016  # expanded by the detached shell
  setsid bash -c 'echo $$ > "$0/cells.pid"; while read -r name opts; do
      [[ -z "$name" || "$name" == \#* ]] && continue
      # shellcheck disable=SC2086
      python3 bench/peers/peers.py modelopt --target "$PWD/.practice/model" --cache "$0/cache" --work "$0/work/$name" \
        --peer-python "$0/peer-python" --max-steps "$1" --eval-prompts "$2" --name "$name" --results "$0/results" \
        --eval-overrides $3 $opts $5 > "$0/$name.log" 2>&1 &
    done < "$4"; wait' "$W" "${STEPS:-1875}" "$EVAL_N" "${EVAL_OVERRIDES:-target.dtype=float32}" "$CELLS" "${PEER_ARGS:-}" \
    > "$W/cells.log" 2>&1 < /dev/null &
  for _ in 1 2 3 4 5; do [ -s "$W/cells.pid" ] && break; sleep 1; done
  echo "cells of $CELLS started (pid $(cat "$W/cells.pid")) at $((SECONDS - T0)) s"
fi
follow
# what the cells that ended have written comes back on every call (a cell's result JSON is written at its end)
cp "$W"/*.log "$LOGS/" 2>/dev/null
for d in "$W"/work/*/; do
  cp "$d/timed.log" "$LOGS/$(basename "$d")-timed.log" 2>/dev/null
  cp "$d/eval/eval.json" "$RESULTS/eval-$(basename "$d").json" 2>/dev/null  # per-prompt counts: compare.py
done
cp "$W"/results/*.json "$RESULTS/" 2>/dev/null
if ! kill -0 "$(cat "$W/cells.pid" 2>/dev/null)" 2>/dev/null; then
  for log in "$W"/*.log; do echo "== $log"; tail -n 3 "$log"; done
  python3 bench/peers/peers.py table "$W"/results/*.json 2>/dev/null
else echo "cells still running; the ended ones' results: $(ls "$W"/results/*.json 2>/dev/null | wc -l)"; fi
echo "suite: $((SECONDS - T0)) s"
finish
