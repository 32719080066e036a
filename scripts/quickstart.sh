#!/usr/bin/env bash
# Installs what is needed, then runs the main job on the bundled default target.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/spot-pipeline submit jobs/synthetic.yaml "$@"
