#!/usr/bin/env bash
# Creates .venv and installs the project with its test tools. Idempotent.
# torch goes first, pinned, so that nothing pulls a multi-GB CUDA build on a CPU machine;
# override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.13.0 --index-url ...") elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v -i "warning: location" || true
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # shellcheck disable=SC2086
  .venv/bin/pip install -q ${TORCH_SPEC:-torch==2.13.0} 2>&1 | grep -v -i "warning: location" || true
fi
# setuptools tells every editable install to beware of folders named like the package
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/pip install -q -e ".[dev]" 2>&1 \
  | grep -v -i "warning: location" || true
.venv/bin/python -c "import torch, spot, pipeline" 
