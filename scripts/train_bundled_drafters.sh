#!/usr/bin/env bash
# Reproduces the bundled drafters in spot/builtin/drafters/ from the bundled targets:
# record each target's own draft-free trajectories on corpus train prompts, then train SPOT
# (static rule) and calibrate its tree sharpness, calibrate Spiffy (static and threshold
# rules) and train SPOT-Sets (threshold rule).
#   TARGETS="sdar-tiny" BLOCKS="32" EPOCHS=6 bash scripts/train_bundled_drafters.sh
# The shipped files were made with (OMP_NUM_THREADS=1, one target per core; recording 2400
# prompts takes 2-11 min, training SPOT on them 5-16 min per target and block; 4800 twice
# that, 9600 four times: 17 min recording and 43 min training on sdar-tiny):
#   TARGETS=sdar-tiny BLOCKS=16 PROMPTS=2400 THRESHOLD_PROMPTS=800 EPOCHS=6 \
#     bash ...
# the same with TARGETS=sdar-nano and TARGETS=llada-tiny, and every target's block 32 with
# PROMPTS=4800, sdar-tiny's and llada-tiny's with PROMPTS=9600 (4800 prompts left
# sdar-tiny's block 16 where 2400 had it). The transfer
# row of the threshold benchmark adapts sdar-nano's SPOT-Sets to sdar-tiny's width:
#   .venv/bin/spot-pipeline train-drafter --kind spot-sets --epochs 6 \
#     --trajectories build/drafters/sdar-tiny-b32-threshold.pt --model builtin:sdar-tiny \
#     --adapt-from spot/builtin/drafters/sdar-nano/spot-sets-b32-threshold.safetensors \
#     --out build/drafters/sdar-tiny-sets-b32-from-sdar-nano.safetensors
set -euo pipefail
cd "$(dirname "$0")/.."
CLI=.venv/bin/spot-pipeline
WORK=${WORK:-build/drafters}
PROMPTS=${PROMPTS:-300}
THRESHOLD_PROMPTS=${THRESHOLD_PROMPTS:-$PROMPTS}  # threshold decoding records fewer steps
EPOCHS=${EPOCHS:-6}
GEN=${GEN:-64}
mkdir -p "$WORK"
for target in ${TARGETS:-sdar-tiny sdar-nano llada-tiny}; do
  out=spot/builtin/drafters/$target
  mkdir -p "$out"
  for block in ${BLOCKS:-16 32}; do
    static=$WORK/$target-b$block.pt
    $CLI record-trajectories --model "builtin:$target" --out "$static" \
      --block-length "$block" --gen-length "$GEN" --prompts "$PROMPTS"
    $CLI train-drafter --kind spot --trajectories "$static" --model "builtin:$target" \
      --out "$out/spot-b$block.safetensors" --epochs "$EPOCHS" --objective "${OBJECTIVE:-order}"
    $CLI calibrate-spot --drafter "$out/spot-b$block.safetensors" --model "builtin:$target"
    $CLI calibrate-spiffy --trajectories "$static" --out "$out/spiffy-b$block.json" --budget 64
    threshold=$WORK/$target-b$block-threshold.pt
    $CLI record-trajectories --model "builtin:$target" --out "$threshold" --hidden \
      --block-length "$block" --gen-length "$GEN" --prompts "$THRESHOLD_PROMPTS" \
      --rule threshold --threshold 0.9
    $CLI calibrate-spiffy --trajectories "$threshold" --budget 64 \
      --out "$out/spiffy-b$block-threshold.json"
    $CLI train-drafter --kind spot-sets --trajectories "$threshold" --model "builtin:$target" \
      --out "$out/spot-sets-b$block-threshold.safetensors" --epochs "$EPOCHS"
  done
done
