#!/usr/bin/env bash
# Reproduces the bundled drafters in spot/builtin/drafters/ from the bundled targets:
# record each target's own draft-free trajectories on corpus train prompts, then train SPOT
# (static rule), calibrate Spiffy (static and threshold rules) and train SPOT-Sets (threshold
# rule).
#   TARGETS="sdar-tiny" BLOCKS="32" EPOCHS=6 bash scripts/train_bundled_drafters.sh
# The shipped files were made with (one thread each, a few minutes per target and block):
#   TARGETS=sdar-tiny BLOCKS="32 16" PROMPTS=200 EPOCHS=2 bash scripts/train_bundled_drafters.sh
#   TARGETS="sdar-nano llada-tiny" BLOCKS="16 32" PROMPTS=150 EPOCHS=2 bash ...
# except llada-tiny's block-16 SPOT-Sets, trained on 800 prompts' threshold trajectories.
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
      --out "$out/spot-b$block.safetensors" --epochs "$EPOCHS"
    $CLI calibrate-spiffy --trajectories "$static" --out "$out/spiffy-b$block.json" --budget 16
    threshold=$WORK/$target-b$block-threshold.pt
    $CLI record-trajectories --model "builtin:$target" --out "$threshold" --hidden \
      --block-length "$block" --gen-length "$GEN" --prompts "$THRESHOLD_PROMPTS" \
      --rule threshold --threshold 0.9
    $CLI calibrate-spiffy --trajectories "$threshold" --budget 16 \
      --out "$out/spiffy-b$block-threshold.json"
    $CLI train-drafter --kind spot-sets --trajectories "$threshold" --model "builtin:$target" \
      --out "$out/spot-sets-b$block-threshold.safetensors" --epochs "$EPOCHS"
  done
done
