#!/usr/bin/env bash
# Everything the GPU path still has to show, in one call on a machine with an NVIDIA GPU (the device
# tool's H100/H200: 10 minutes per command, no network). Prepare here first: bench/gpu_wheels.sh
# (the serving packages the GPU image lacks, into .whl/), then on the device:
#
#   run(command="bash bench/gpu_run.sh", carry=[".whl"], timeout_s=600)
#
# Stages (each bounded by `timeout`, together under 10 minutes; each writes its log as it goes, so a stage
# that overruns costs only itself and what is under $OUT still comes back; to split the work over two
# calls, name the stages: `bash bench/gpu_run.sh tests sanitizer h2d costs`, then `... e2e`):
#   tests      the CUDA tests (tests/test_gpu.py) and the CPU ones of the GPU path beside them
#   sanitizer  TORCH_CUDA_SANITIZER=1 over the CUDA worker tests: the stream-race check
#   h2d        python -m bench gpu: H2D from the arena vs pinned and pageable, copy/compute overlap
#   costs      python -m bench startup (worker start, compiled normalisation cold/warm) and
#              python -m bench preprocess-model (the frontends' decode cost: the ceiling is cores / that)
#   e2e        python -m bench gpu, end to end: default model, 1024 px misses, c = 1, 8, 32, 128, 1/2/4 workers
#              per GPU, against LitServe with the same model code on the same GPU
# Usage: bench/gpu_run.sh [--dry-run] [STAGE ...]   (default: every stage)
# --dry-run runs the same stages in their CPU form (CUDA tests skip, benches run on the CPU, smaller), so
# this script can be checked anywhere before a GPU session spends its time on it.
# Results: $OUT (the device tool's folder) or bench/results/gpu-<time>/: summary.txt (environment and each
# stage's exit status) and at most 7 more files (the device tool brings back 8).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
repo="$(pwd)"

dry_run=0
stages=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry_run=1 ;;
        tests|sanitizer|h2d|costs|e2e) stages+=("$arg") ;;
        *) echo "unknown argument: $arg (stages: tests sanitizer h2d costs e2e; --dry-run)" >&2; exit 2 ;;
    esac
done
[ ${#stages[@]} -gt 0 ] || stages=(tests sanitizer h2d costs e2e)

out="${OUT:-$repo/bench/results/gpu-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
summary="$out/summary.txt"
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE

# The interpreter: this checkout's .venv where there is one (development machine), else the image's python3
# with the carried wheels installed beside it (GPU machine).
if [ -x .venv/bin/python ]; then
    py=.venv/bin/python
else
    py=python3
    if compgen -G ".whl/*.whl" > /dev/null; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || { echo "installing the carried wheels failed" >&2; exit 1; }
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

{
    echo "# bench/gpu_run.sh $*  ($(date -u +%Y-%m-%dT%H:%M:%SZ), dry run: $dry_run)"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    "$py" -c 'import os, sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda",
torch.version.cuda, "available", torch.cuda.is_available(), "cores", os.cpu_count())'
    df -h /dev/shm | tail -1
} > "$summary" 2>&1

# stage NAME LIMIT_S COMMAND...: run it under a time limit, log to NAME.log, record its exit status.
stage() {
    local name="$1" limit="$2"
    shift 2
    echo "== $name: $*" | tee -a "$summary"
    local began=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "   $name: exit $rc after $((SECONDS - began)) s" | tee -a "$summary"
    tail -3 "$out/$name.log"
}

gpu_tests=(tests/test_gpu.py)
cpu_tests=(tests/test_device.py tests/test_normalise.py tests/test_cli_gpus.py)
if [ "$dry_run" = 1 ]; then
    bench_mode=(--dry-run)
    startup_device=cpu
    e2e=(--frontends 1 --concurrency 4 --requests 8)
else
    bench_mode=(--quick)
    startup_device=cuda
    cores=$(nproc)
    e2e=(--frontends $((cores > 6 ? cores - 4 : 2)) --concurrency 1 8 32 128 --workers-per-gpu 1 2 4 --requests 200)
fi

for s in "${stages[@]}"; do
    case "$s" in
        tests)
            stage tests 120 "$py" -m pytest -q -rs -p no:cacheprovider "${gpu_tests[@]}" "${cpu_tests[@]}" ;;
        sanitizer)
            stage sanitizer 90 env TORCH_CUDA_SANITIZER=1 "$py" -m pytest -q -rs -p no:cacheprovider \
                "${gpu_tests[@]}" -k "worker or token_ids or exact or backend" ;;
        h2d)
            stage h2d 90 "$py" -m bench gpu "${bench_mode[@]}" --skip-serve --arena-size $((256 << 20)) \
                --out "$out/h2d.md" ;;
        costs)
            stage costs 90 bash -c "'$py' -m bench preprocess-model --rounds 5; \
                '$py' -m bench startup --device $startup_device --runs 1" ;;
        e2e)
            stage e2e 200 "$py" -m bench gpu "${bench_mode[@]}" --skip-h2d --skip-overlap --litserve \
                --arena-size $((1 << 30)) "${e2e[@]}" --out "$out/e2e.md" ;;
    esac
done
echo "results in $out" | tee -a "$summary"
