#!/usr/bin/env bash
# Reproduces the bundled tokenizer, held-out prompts and targets in spot/builtin/ on CPU, then
# prints their draft-free quality table (the one in the README). Two trainings run side by
# side, one thread each (about 50 minutes on 2 cores in all); loss logs go to $WORK.
set -euo pipefail
cd "$(dirname "$0")/.."
CLI=.venv/bin/spot-pipeline
WORK=${WORK:-build/targets}
mkdir -p "$WORK"
$CLI build-corpus
$CLI train-target sdar-tiny --threads 1 --log "$WORK/sdar-tiny.log" &
sdar=$!
($CLI train-target llada-tiny --threads 1 --log "$WORK/llada-tiny.log" &&
  $CLI train-target sdar-nano --threads 1 --log "$WORK/sdar-nano.log") &
rest=$!
wait "$sdar"
wait "$rest"
$CLI evaluate-target --threads 2
