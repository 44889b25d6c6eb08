#!/usr/bin/env bash
# Set up (first run), run the static checks (ruff, mypy; configured in pyproject.toml), then the whole
# test suite. Extra arguments go to pytest. SHMGATE_SKIP_LINT=1 skips the static checks.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,hf
if [ "${SHMGATE_SKIP_LINT:-0}" != 1 ]; then
  .venv/bin/ruff check .
  .venv/bin/mypy
fi
exec .venv/bin/python -m pytest -q "$@"
