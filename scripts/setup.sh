#!/usr/bin/env bash
# Create .venv and install shmgate with its test and Hugging Face extras. Idempotent.
#
# torch is installed first and pinned, so pip never resolves "torch" on its own: on a
# machine with a local CPU wheel (or PyTorch's CPU index in TORCH_INDEX_URL) that gives a
# CPU build; from PyPI on Linux it is the CUDA build a GPU user wants.
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 scripts/setup.sh   # pick a build
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${PIP[@]}" "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"
  else
    "${PIP[@]}" "torch==${TORCH_VERSION}"
  fi
fi
"${PIP[@]}" -e ".[test,hf]"
