#!/usr/bin/env bash
# Issue 36: the peer's step time at the Qwen3-8B shape, to price its cells at 8B GPU time. A random-weight 8B
# checkpoint with the practice tokenizer (bench/peers/random_target.py), then ModelOpt's DFlash example trained STEPS
# steps on it per cell of PEER_CELLS ("NAME bench/peers/peers.py-option ..." separated by ';', as a line of bench/peers/cells/;
# `--no-eval`: its JSON's `step_s_after_warmup`), then, unless OURS is empty, ours at the same shape (bench/speed/run.py,
# ShareGPT lengths). A batch-size point of the peer: "anchors80-b8 --batch 8 --peer-overrides dflash.dflash_num_anchors=80".
#   [STEPS=30] [DEADLINE_S=...] [PEER_CELLS="default;anchors80 --peer-overrides dflash.dflash_num_anchors=80"] [OURS=1] bash bench/peers/peer_step_8b.sh
# Carry .whl, .whl-peer, .practice, .peer/modelopt and .quality/first200 (its data cache; with .whl-peer, all of .peer
# is over the 64 MiB carry).
source "$(dirname "$0")/../common.sh"
W=/tmp/peer8b; rm -rf "$W"; mkdir -p "$W/cache"
cat .quality/first200/quality-cache.tar.gz.part* | tar xzf - -C "$W/cache" || { echo "carry .quality/first200"; exit 1; }
peer_env "$W" || { finish; exit 1; }
step target 240 python3 bench/peers/random_target.py --preset qwen3-8b --tokenizer .practice/model --out "$W/q8b" \
  || { finish; exit 1; }
IFS=';' read -ra CELLS <<< "${PEER_CELLS-default;anchors80 --peer-overrides dflash.dflash_num_anchors=80}"
for cell in "${CELLS[@]}"; do
  read -r name opts <<< "$cell"
  # DEADLINE_S: price no setting that could run past this many seconds into the suite (a caller's later steps)
  if (( SECONDS + ${PEER_S:-200} > ${DEADLINE_S:-100000} )); then echo "no time left to price $name"; continue; fi
  # shellcheck disable=SC2086  # the options split on spaces
  step "peer-$name" "${PEER_S:-200}" python3 bench/peers/peers.py modelopt --target "$W/q8b" --cache "$W/cache" \
    --work "$W/work-$name" --peer-python "$W/peer-python" --max-steps "${STEPS:-30}" --no-eval \
    --name "modelopt-8b-$name" --results "$RESULTS" $opts
done
if [ -n "${OURS-1}" ]; then
  step ours "${OURS_S:-200}" python3 bench/speed/run.py --model qwen3-8b --workload sharegpt --no-baseline \
    --compile-target --warmup 6 --steps 10 --out "$RESULTS"
fi
finish
