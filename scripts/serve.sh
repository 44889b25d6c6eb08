#!/usr/bin/env bash
# Set up (first run: .venv, torch, shmgate[hf]; later runs skip pip) and start shmgate on the embedded
# EfficientNet-Lite0 model.
# Extra arguments go to `shmgate serve`, e.g. scripts/serve.sh --port 8080 --workers 2
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh hf  # serving needs only shmgate[hf]; skipped when already installed
exec .venv/bin/shmgate serve "$@"
