#!/usr/bin/env bash
# Runs the Dockerfile's build steps without Docker, in a fresh virtual environment:
#   bash infra/build_outside_docker.sh [VENV_DIR]     (default: a temporary folder, removed)
# The Dockerfile copies the sources and runs infra/install.sh; this does the same with a
# copy of the same files, so a broken image build shows up here first.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
VENV=${1:-$WORK/venv}
# the files the Dockerfile copies (its COPY lines), nothing else
mkdir -p "$WORK/src/infra"
cp -r "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/spot" "$ROOT/pipeline" "$ROOT/spot_common" "$ROOT/spot_factory" "$WORK/src/"
cp "$ROOT/infra/install.sh" "$WORK/src/infra/"
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
"${PYTHON:-python3}" -m venv "$VENV"
cd "$WORK/src"
bash infra/install.sh "$VENV/bin/python" .
echo "image build steps passed in $VENV"
