#!/usr/bin/env bash
# Create .venv and install shmgate with the extras named (default: hf). Idempotent and quick when nothing
# changed: scripts/serve.sh runs it on every start.
#
#   scripts/setup.sh            # serving: shmgate[hf]  (scripts/serve.sh)
#   scripts/setup.sh test,hf    # tests too              (scripts/test.sh)
#
# Python: 3.11 or newer (PYTHON=python3.12 scripts/setup.sh picks another interpreter); checked before
# anything is downloaded.
#
# torch is installed first and pinned, so pip never resolves "torch" on its own: on a machine with a
# local CPU wheel (or PyTorch's CPU index in TORCH_INDEX_URL) that gives a CPU build; from PyPI on Linux it
# is the CUDA build a GPU user wants.
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 scripts/setup.sh   # pick a build
#
# pip runs only when needed: each extra installed records the hash of pyproject.toml and setup.py it was installed from
# (.venv/.shmgate-setup/<extra>); when every extra asked for is recorded with the current hash, pip is
# skipped. The install is editable, so a change to the code needs no reinstall; a change to pyproject.toml
# (new dependencies) does. SHMGATE_SETUP_FORCE=1 reinstalls anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
EXTRAS=${1:-hf}
MARKERS=.venv/.shmgate-setup

# The Python that will run shmgate: the venv's if it exists, else the one that would create it.
python_for_check=$PYTHON
[ -x .venv/bin/python ] && python_for_check=.venv/bin/python
if ! command -v "$python_for_check" > /dev/null; then
    echo "scripts/setup.sh: no '$python_for_check' on PATH; shmgate needs Python 3.11 or newer (set PYTHON=...)" >&2
    exit 2
fi
if ! "$python_for_check" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    found=$("$python_for_check" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2> /dev/null || echo unknown)
    if [ "$python_for_check" = .venv/bin/python ]; then
        echo "scripts/setup.sh: .venv has Python $found; shmgate needs 3.11 or newer." \
            "Remove .venv and run again with PYTHON=python3.11 (or newer)." >&2
    else
        echo "scripts/setup.sh: $PYTHON is Python $found; shmgate needs 3.11 or newer." \
            "Install one (e.g. apt-get install python3.11 python3.11-venv) and run PYTHON=python3.11 $0" >&2
    fi
    exit 2
fi

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# find_spec, not import: importing torch takes seconds, and this runs on every scripts/serve.sh start.
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        "${PIP[@]}" "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"
    else
        "${PIP[@]}" "torch==${TORCH_VERSION}"
    fi
fi

hash=$(.venv/bin/python -c 'import hashlib; print(hashlib.sha256(b"".join(open(f, "rb").read() for f in ("pyproject.toml", "setup.py"))).hexdigest())')
installed() { # installed EXTRA: recorded with the current pyproject.toml, and shmgate still importable
    [ "$(cat "$MARKERS/$1" 2> /dev/null)" = "$hash" ]
}
needed=0
[ "${SHMGATE_SETUP_FORCE:-0}" = 1 ] && needed=1
.venv/bin/python -c 'import importlib.metadata as m; m.version("shmgate")' 2> /dev/null || needed=1
for extra in core ${EXTRAS//,/ }; do
    installed "$extra" || needed=1
done
if [ "$needed" = 1 ]; then
    "${PIP[@]}" -e ".[${EXTRAS}]"
    mkdir -p "$MARKERS"
    for extra in core ${EXTRAS//,/ }; do
        printf '%s\n' "$hash" > "$MARKERS/$extra"
    done
fi
