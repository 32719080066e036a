#!/usr/bin/env bash
# The GPU checks, on a machine with CUDA, in under 10 minutes (each step has a limit):
#   1. the GPU tests: shipped drafters lossless with the target on the GPU (T=0, 0.8, budget
#      auto), decoding with a prefix cache held on the GPU equal to decoding without one,
#      coupled noise made on the GPU equal to the CPU's;
#   2. bench/gpu_forward.py: one forward's cost at SDAR-8B / LLaDA-8B dimensions as the
#      verified tree grows, and the throughput the shipped SPOT drafter's curve implies;
#   3. bench/continuous_batching.py: static against continuous batching on the bundled
#      held-out prompts, draft-free and SPOT budget auto, with the target on the GPU;
#   4. bench/prefix_cache.py: prompts behind a ~300-token system prompt against a 6-token
#      one, with and without the prefix cache, the target on the GPU;
#   5. bench/pipeline_batches.py: real `submit` jobs on the GPU (when Ray is installed):
#      requests per forward across replica calls at batch 32, and the prefix cache in a job
#      behind the long system prompt, on and off, with the same tokens;
#   6. the replica's failure handling with the target on the GPU (out of memory above batch
#      2 halves the batch, a failing row alone is an error row).
# Runs with .venv/bin/python when there is one, else $PYTHON or python3 (a machine's own
# torch with CUDA, transformers, safetensors and tokenizers; neither Ray nor DeepSpeed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device')"
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"

echo "== 1. GPU tests"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_commit_rules.py \
  -k "gpu or cuda"

echo "== 2. forward cost at 8B dimensions (bf16, random weights)"
timeout 150 "$PY" bench/gpu_forward.py --time-limit 120 \
  --drafter spot/builtin/drafters/sdar-tiny/spot-b32.safetensors

echo "== 3. static vs continuous batching, sdar-tiny on the GPU, 400 held-out prompts"
timeout 180 "$PY" bench/continuous_batching.py --device cuda --prompts 400 --batch-sizes 8 32

echo "== 4. prefix cache, sdar-tiny on the GPU, 16 held-out prompts behind two system prompts"
timeout 90 "$PY" bench/prefix_cache.py --device cuda --prompts 16

echo "== 5. full batches and the prefix cache in real jobs, sdar-tiny on the GPU"
if "$PY" -c "import ray" 2>/dev/null; then
  timeout 150 "$PY" bench/pipeline_batches.py --gpu --target sdar-tiny --gen-length 64 \
    --block-length 32 --batch-size 32 --rows 800 --system-prompt long --prefix-cache auto 0
else
  echo "skipped: no Ray in $PY"
fi

echo "== 6. the replica's failure handling, the target on the GPU"
SPOT_TEST_DEVICE=cuda timeout 60 "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_replica_decoder.py -k "out_of_memory or fails_becomes"
