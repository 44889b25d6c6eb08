#!/usr/bin/env bash
# Try an `hf:` model offline: build a tiny, randomly initialised Qwen2-VL checkpoint (2 layers, 64 wide, a
# tokenizer trained on the spot; tests/hf_fixture.py, the one the tests use) in a temporary directory and
# serve it with `shmgate serve --model hf:<dir>`. Nothing is downloaded: it shows the whole `hf:` path
# (processor and chat template in the frontends, pixel_values through the arena, tokens streamed from
# the worker) in seconds. The weights are random, so the answers are gibberish.
#
#   scripts/try_hf.sh                      # serves model `tiny-qwen2-vl` on 127.0.0.1:8000
#   scripts/try_hf.sh --port 8080          # extra arguments go to `shmgate serve`
#   TRY_HF_FAMILY=idefics3 scripts/try_hf.sh   # another chat family of tests/hf_fixture.py's FAMILIES
#   TRY_HF_FAMILY=clip scripts/try_hf.sh       # an embedder (clip, siglip, siglip2): /v1/embeddings
#
# A wrong name stops it with the valid ones (tests/tiny_models.py, which also writes a checkpoint to a
# directory of your own: .venv/bin/python -m tests.tiny_models FAMILY DIR). The checkpoint is removed
# when the server stops (Ctrl-C).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh hf
FAMILY=${TRY_HF_FAMILY:-qwen2_vl}
DIR=$(mktemp -d "${TMPDIR:-/tmp}/shmgate-try-hf.XXXXXX")
trap 'rm -rf -- "$DIR"' EXIT
MODEL_DIR=$DIR/tiny-${FAMILY//_/-}
echo "try_hf: building a tiny random $FAMILY checkpoint in $MODEL_DIR" >&2
# stops here (status 2) with the valid names when FAMILY is not one of them
.venv/bin/python -m tests.tiny_models "$FAMILY" "$MODEL_DIR" > /dev/null
echo "try_hf: serving it as model '$(basename "$MODEL_DIR")' (random weights: what it answers is gibberish)" >&2
# Not exec: the trap removes the checkpoint once the server has stopped.
.venv/bin/shmgate serve --model "hf:$MODEL_DIR" --device cpu "$@"
