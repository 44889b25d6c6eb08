"""Two shmgate units behind nginx, then a rolling restart under load: no request fails (short run).

The longer run is ``python -m bench scaleout``; its figures are in docs/RELIABILITY.md. Each unit is a
pod in a box (bench_client/pods.py): its own IPC and mount namespace and /dev/shm, a gateway and a
worker container.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shmgate.bench_client.pods import pods_unavailable

REPO = Path(__file__).resolve().parent.parent


# Alone on the machine: on cores saturated by the parallel phase a worker exited 1 in 2 of 3 suite runs where
# its stop was asked for (its log tail is now in the assertion's message); alone it passed every run.
@pytest.mark.serial
def test_rolling_restart_of_two_units_behind_nginx_fails_no_request() -> None:
    reason = pods_unavailable()
    if reason:
        pytest.skip(reason)
    if shutil.which("nginx") is None and not shutil.which("/usr/sbin/nginx"):
        pytest.skip("nginx is not installed (apt-get install nginx)")
    short = ["--concurrency", "8", "--requests", "100", "--steady-s", "2", "--settle-s", "1", "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "bench", "scaleout", *short], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.stdout.strip(), done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bench_failures"] == []
    assert result["steady"]["requests"] > 0 and result["steady"]["errors"] == 0
    restart = result["rolling_restart"]
    assert [(r["gateway_exit"], r["worker_exit"]) for r in restart["restarts"]] == [(0, 0), (0, 0)], restart
    assert restart["load_covered_it"], restart
    assert restart["requests"] > 0
    assert restart["errors"] == 0, restart["errors_by_kind"]
    assert restart["mismatches"] == 0
