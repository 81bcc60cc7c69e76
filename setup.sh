#!/usr/bin/env bash
# Creates .venv with torch 2.13.0 and this project installed, editable, with its test extras (idempotent).
#   TORCH_INDEX_URL=URL bash setup.sh   installs torch from that wheel index (e.g. PyTorch's CPU-only or a
#                                       CUDA index); without it pip's own configuration decides, and on
#                                       Linux PyPI's torch wheel is the CUDA build (several GB of nvidia-*).
#   A torch already in .venv (say a CUDA build you installed first) is kept.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/pip install --quiet "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
.venv/bin/pip install --quiet -e ".[test]"
.venv/bin/python - <<'PY'
import torch
build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
print(f"setup: .venv has torch {torch.__version__} ({build}) and memo-train (editable, console script .venv/bin/memo)")
PY
