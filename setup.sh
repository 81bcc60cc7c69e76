#!/usr/bin/env bash
# Creates .venv with the pinned CPU torch and the project installed (idempotent).
# GPU users: install your CUDA build of torch into .venv first; this script keeps it.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/pip install --quiet "torch==2.13.0"
fi
.venv/bin/pip install --quiet -e ".[test]"
