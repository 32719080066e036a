#!/usr/bin/env bash
# Reproduces the bundled tokenizer, held-out prompts and targets in spot/builtin/ on CPU, then
# prints their draft-free quality table (docs/benchmarks.md §1). sdar-tiny trains alone on both
# cores (about 52 minutes), then llada-tiny and sdar-nano side by side, one thread each (about
# 22 minutes); loss logs go to $WORK.
set -euo pipefail
cd "$(dirname "$0")/.."
CLI=.venv/bin/spot-factory
WORK=${WORK:-build/targets}
mkdir -p "$WORK"
$CLI build-corpus --into-package
$CLI train-target sdar-tiny --into-package --threads 2 --log "$WORK/sdar-tiny.log"
$CLI train-target llada-tiny --into-package --threads 1 --log "$WORK/llada-tiny.log" &
llada=$!
$CLI train-target sdar-nano --into-package --threads 1 --log "$WORK/sdar-nano.log"
wait "$llada"
$CLI evaluate-target --threads 2
