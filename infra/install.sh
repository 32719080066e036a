#!/usr/bin/env bash
# The image's build steps (infra/Dockerfile runs exactly this), runnable without Docker:
#   bash infra/install.sh PYTHON [SOURCE_DIR]
# Installs torch first (TORCH_SPEC, default the pinned version; on Linux the PyPI wheel
# carries CUDA), then the project with its dependencies (Ray with the dashboard and Jobs
# API, DeepSpeed), then checks that everything imports and the CLI's commands load.
set -euo pipefail
PYTHON=${1:?usage: install.sh PYTHON [SOURCE_DIR]}
SOURCE=${2:-.}
PIP=("$PYTHON" -m pip install --no-cache-dir --disable-pip-version-check)
# shellcheck disable=SC2086
"${PIP[@]}" ${TORCH_SPEC:-torch==2.13.0}
"${PIP[@]}" "$SOURCE"
"$PYTHON" - <<'PY'
import deepspeed, ray, torch, transformers
import pipeline.cli, spot.models.tensor_parallel, spot.decode
from deepspeed import init_distributed, init_inference  # what tensor_parallel calls
from ray.job_submission import JobSubmissionClient  # Jobs API (ray[default])
print(f"torch {torch.__version__} (cuda {torch.version.cuda}), ray {ray.__version__}, "
      f"deepspeed {deepspeed.__version__}, transformers {transformers.__version__}")
PY
for command in submit validate estimate report; do
  "$(dirname "$PYTHON")/spot-pipeline" "$command" --help > /dev/null
done
