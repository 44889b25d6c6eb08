"""Two shmgate units behind nginx, then a rolling restart under load: no request fails (short run).

The longer run is bench/scaleout.py; its figures are in docs/RELIABILITY.md. Each unit is a pod in a
box (bench/pods.py): its own IPC and mount namespace and /dev/shm, a gateway and a worker container.
"""

from __future__ import annotations

import argparse
import shutil

import pytest

from bench import scaleout
from bench.pods import pods_unavailable


def test_rolling_restart_of_two_units_behind_nginx_fails_no_request() -> None:
    reason = pods_unavailable()
    if reason:
        pytest.skip(reason)
    if shutil.which("nginx") is None and not shutil.which("/usr/sbin/nginx"):
        pytest.skip("nginx is not installed (apt-get install nginx)")
    args = argparse.Namespace(
        model="checksum",
        concurrency=8,
        requests=100,
        steady_s=2.0,
        settle_s=1.0,
        frontends=1,
        worker_threads=1,
        work_dir=None,
    )
    result = scaleout.run(args)
    assert result["bench_failures"] == []
    assert result["steady"]["requests"] > 0 and result["steady"]["errors"] == 0
    restart = result["rolling_restart"]
    assert [(r["gateway_exit"], r["worker_exit"]) for r in restart["restarts"]] == [(0, 0), (0, 0)]
    assert restart["load_covered_it"], restart
    assert restart["requests"] > 0
    assert restart["errors"] == 0, restart["errors_by_kind"]
    assert restart["mismatches"] == 0
