#!/usr/bin/env bash
# c=1 latency and CPU per request of two commits, run from ONE checkout path, in ABBA order.
#
# Why one path: a worker's speed depends on where its process's memory lands, which each server
# start decides, and the checkout's path (cwd, PYTHONPATH: the size of the environment, the stack's
# start) seems to move too. Measured here: one commit ran its workers at 17 or 22 ms of CPU
# per request from start to start, and an A/B through two worktrees showed a 2-3 ms c=1
# "regression" that an A/B at one path did not (docs/BENCHMARKS.md). So both commits are checked
# out in turn into one worktree and run A B B A ..., and several pairs average the starts out.
#
# Usage: bench/ab_c1.sh COMMIT_A COMMIT_B [PAIRS] [REQUESTS]   (from the repository root, .venv set up)
# Prints one line per run: commit, req/s, p50 ms, p99 ms, and worker / frontend CPU ms per request.
# CONCURRENCY=32 loads it harder; BACKGROUND_CORES=1 adds bench/disturb.py's spinning load to each run.
set -euo pipefail
A=$(git rev-parse --short "${1:?commit A}"); B=$(git rev-parse --short "${2:?commit B}"); PAIRS=${3:-2}; N=${4:-300}
ROOT=$(pwd); TREE=$(mktemp -d /tmp/shmgate-ab.XXXXXX); PORT=${PORT:-8124}
C=${CONCURRENCY:-1}; SPIN=${BACKGROUND_CORES:-0}
git worktree add --detach "$TREE" "$A" >/dev/null 2>&1
trap 'kill "${SERVER:-}" "${SPINNER:-}" 2>/dev/null || true; git -C "$ROOT" worktree remove --force "$TREE"' EXIT

cpu() {  # "role ticks" for every frontend and worker process
  for p in $(pgrep -f "gateway frontend|worker" || true); do
    role=$(ps -o args= -p "$p" | grep -o 'frontend\|worker' | head -1) || continue
    echo "$p $role $(awk '{print $14+$15}' "/proc/$p/stat" 2>/dev/null || echo 0)"
  done
}

ORDER=()
for _ in $(seq "$PAIRS"); do ORDER+=("$A" "$B" "$B" "$A"); done
for commit in "${ORDER[@]}"; do
  git -C "$TREE" checkout -q --detach "$commit"
  (cd "$TREE" && PYTHONPATH="$TREE" exec "$ROOT/.venv/bin/shmgate" serve --port "$PORT" --model efficientnet-lite0) \
    > "$TREE.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 120); do curl -sf -o /dev/null "localhost:$PORT/ready" && break; sleep 0.5; done
  bench=("$ROOT/.venv/bin/shmgate" bench --base-url "http://127.0.0.1:$PORT" --model efficientnet-lite0
         --images "$ROOT/tests/data/images" --unique -c "$C" --no-stages)
  "${bench[@]}" -n 50 > /dev/null  # warm-up
  if [ "$SPIN" != 0 ]; then
    "$ROOT/.venv/bin/python" "$ROOT/bench/disturb.py" --cores "$SPIN" --seconds 600 & SPINNER=$!
  fi
  cpu > "$TREE.before"
  result=$("${bench[@]}" -n "$N" --json | tail -1)
  cpu > "$TREE.after"
  if [ -n "${SPINNER:-}" ]; then kill "$SPINNER"; wait "$SPINNER" 2>/dev/null || true; SPINNER=; fi
  python3 - "$commit" "$N" "$result" "$TREE.before" "$TREE.after" <<'PY'
import json, os, sys
commit, n, result, before, after = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
read = lambda path: {f[0]: (f[1], int(f[2])) for f in (line.split() for line in open(path)) if len(f) == 3}
a, b = read(before), read(after)
ms = {}
for pid, (role, ticks) in b.items():
    if pid in a:
        ms[role] = ms.get(role, 0.0) + (ticks - a[pid][1]) * 1000 / os.sysconf("SC_CLK_TCK") / n
print(f"{commit[:9]}  {result['requests_per_s']:6.1f} req/s  p50 {result['p50_ms']:6.1f} ms  p99 {result['p99_ms']:6.1f} ms  "
      f"worker {ms.get('worker', 0):5.2f} ms/req  frontend {ms.get('frontend', 0):5.2f} ms/req", flush=True)
PY
  kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; SERVER=
  sleep 1
done
