#!/usr/bin/env bash
# Set up (first run), run the static checks (ruff check, ruff format --check, scripts/typecheck.sh; configured in
# pyproject.toml), then the test suite in two phases, each printing its 25 slowest tests:
#   1. every test not marked `serial`, three processes side by side (pytest-xdist, `--dist loadfile`: a
#      file's tests stay in one process, so its module-scoped servers start once; files are handed out
#      longest first, the order tests/conftest.py LONGEST_FIRST gives them);
#   2. the `serial` tests, alone on the machine: they diff all of /dev/shm, fill the per-uid message-queue
#      budget on purpose, remove every dead instance (`shmgate cleanup`, a serve's start-up clean-up), or
#      time a stall, or restart pods under load (on saturated cores a worker's exit code races its SIGTERM).
# mypy (scripts/typecheck.sh) runs beside phase 1, niced, and is waited for before phase 2: on a clean
# clone it has no cache and takes ~30 s of CPU, which it takes from the gaps phase 1's waits leave.
# Phase 2 collects only the files phase 1 found serial tests in (tests/conftest.py; importing every test
# file costs ~14 s of CPU), or every file if phase 1 did not get that far.
# Exits non-zero if the static checks or either phase fail (both phases always run). Extra arguments go to pytest in both phases, so
# `scripts/test.sh tests/test_x.py` runs that file's tests, each in its phase. SHMGATE_TEST_PROCESSES sets
# phase 1's processes (default 3: on 2 cores many tests wait on servers, heartbeats and timeouts, and 3
# finished in 5.5 min where 2 took 6.7; 0 runs it in this process); SHMGATE_SKIP_LINT=1 skips the
# static checks.
# The tests start real servers, whose message queues are charged to this user's RLIMIT_MSGQUEUE (`ulimit
# -q`): another shmgate instance of the same user holding part of it would fail the suite in many places,
# so tests/mq_preflight.py checks the budget first and says so once (SHMGATE_SKIP_MQ_CHECK=1 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
# Compiled modules are cached (__pycache__, git-ignored) even where PYTHONDONTWRITEBYTECODE is set: without
# the cache each pytest process rewrites the asserts of every test file again (~5.5 s of CPU a process).
unset PYTHONDONTWRITEBYTECODE
scripts/setup.sh test,hf
scratch=$(mktemp -d)
typecheck_pid=
cleanup() {
  if [ -n "$typecheck_pid" ]; then
    kill -- "-$typecheck_pid" 2>/dev/null || true # its process group: mypy too
  fi
  rm -rf "$scratch"
}
trap cleanup EXIT
if [ "${SHMGATE_SKIP_LINT:-0}" != 1 ]; then
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  setsid nice -n 10 scripts/typecheck.sh > "$scratch/typecheck.log" 2>&1 &
  typecheck_pid=$!
fi

if [ "${SHMGATE_SKIP_MQ_CHECK:-0}" != 1 ]; then
  SHMGATE_TEST_PROCESSES=${SHMGATE_TEST_PROCESSES:-3} .venv/bin/python -m tests.mq_preflight
fi

# pytest's exit status 5 means "no tests collected": a phase with nothing selected (a file with no serial
# tests) is not a failure, but both phases selecting nothing (a -k that matches no test) is pytest's 5.
processes=${SHMGATE_TEST_PROCESSES:-3}
echo "== scripts/test.sh: tests that can share the machine, $processes processes"
parallel=0
SHMGATE_SERIAL_FILES_OUT="$scratch/serial-files" \
  .venv/bin/python -m pytest -q -n "$processes" --dist loadfile --no-loadscope-reorder -m "not serial" "$@" ||
  parallel=$?
typecheck=0
if [ -n "$typecheck_pid" ]; then
  echo "== scripts/test.sh: scripts/typecheck.sh"
  wait "$typecheck_pid" || typecheck=$?
  typecheck_pid=
  cat "$scratch/typecheck.log"
fi
echo "== scripts/test.sh: serial tests, alone"
serial=0
if [ ! -e "$scratch/serial-files" ]; then
  .venv/bin/python -m pytest -q -m serial "$@" || serial=$?
elif [ -s "$scratch/serial-files" ]; then
  SHMGATE_COLLECT_ONLY="$scratch/serial-files" .venv/bin/python -m pytest -q -m serial "$@" || serial=$?
else
  echo "(none selected)"
  serial=5
fi
if [ "$typecheck" != 0 ]; then
  echo "scripts/test.sh: scripts/typecheck.sh failed (exit $typecheck)" >&2
fi
if [ "$parallel" = 5 ] && [ "$serial" = 5 ] && [ "$typecheck" = 0 ]; then
  echo "scripts/test.sh: no test selected" >&2
  exit 5
fi
[ "$parallel" = 5 ] && parallel=0
[ "$serial" = 5 ] && serial=0
if [ "$parallel" != 0 ] || [ "$serial" != 0 ] || [ "$typecheck" != 0 ]; then
  echo "scripts/test.sh: failed (parallel phase: exit $parallel, serial phase: exit $serial, typecheck: exit $typecheck)" >&2
  exit 1
fi
