#!/usr/bin/env bash
# Set up (first run), run the static checks (ruff check, ruff format --check, scripts/typecheck.sh; configured in
# pyproject.toml), then the test suite in two phases, each printing its 25 slowest tests:
#   1. every test not marked `serial`, three processes side by side (pytest-xdist, `--dist loadfile`: a
#      file's tests stay in one process, so its module-scoped servers start once; files are handed out
#      longest first, the order tests/conftest.py LONGEST_FIRST gives them);
#   2. the `serial` tests, alone on the machine: they diff all of /dev/shm, fill the per-uid message-queue
#      budget on purpose, remove every dead instance (`shmgate cleanup`, a serve's start-up clean-up), or
#      time a stall.
# Exits non-zero if either phase fails (both always run). Extra arguments go to pytest in both phases, so
# `scripts/test.sh tests/test_x.py` runs that file's tests, each in its phase. SHMGATE_TEST_PROCESSES sets
# phase 1's processes (default 3: on 2 cores many tests wait on servers, heartbeats and timeouts, and 3
# finished in 5.5 min where 2 took 6.7; 0 runs it in this process); SHMGATE_SKIP_LINT=1 skips the
# static checks.
# The tests start real servers, whose message queues are charged to this user's RLIMIT_MSGQUEUE (`ulimit
# -q`): another shmgate instance of the same user holding part of it would fail the suite in many places,
# so tests/mq_preflight.py checks the budget first and says so once (SHMGATE_SKIP_MQ_CHECK=1 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test,hf
if [ "${SHMGATE_SKIP_LINT:-0}" != 1 ]; then
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  scripts/typecheck.sh
fi

if [ "${SHMGATE_SKIP_MQ_CHECK:-0}" != 1 ]; then
  SHMGATE_TEST_PROCESSES=${SHMGATE_TEST_PROCESSES:-3} .venv/bin/python -m tests.mq_preflight
fi

# pytest's exit status 5 means "no tests collected": a phase with nothing selected (a file with no serial
# tests) is not a failure, but both phases selecting nothing (a -k that matches no test) is pytest's 5.
processes=${SHMGATE_TEST_PROCESSES:-3}
echo "== scripts/test.sh: tests that can share the machine, $processes processes"
parallel=0
.venv/bin/python -m pytest -q -n "$processes" --dist loadfile --no-loadscope-reorder -m "not serial" "$@" || parallel=$?
echo "== scripts/test.sh: serial tests, alone"
serial=0
.venv/bin/python -m pytest -q -m serial "$@" || serial=$?
if [ "$parallel" = 5 ] && [ "$serial" = 5 ]; then
  echo "scripts/test.sh: no test selected" >&2
  exit 5
fi
[ "$parallel" = 5 ] && parallel=0
[ "$serial" = 5 ] && serial=0
if [ "$parallel" != 0 ] || [ "$serial" != 0 ]; then
  echo "scripts/test.sh: failed (parallel phase: exit $parallel, serial phase: exit $serial)" >&2
  exit 1
fi
