"""The soak (``python -m bench soak``), short: a few hundred mixed requests leave nothing behind.

The full run (20,000 requests) is a benchmark; its figures are in docs/RELIABILITY.md. The soak
calls any growth of a process's descriptors or threads in the timed run's second half a leak, so
the server keeps them fixed at rest whatever its load history: the unit tests below pin the parts
that used to grow on first use (CI once saw a worker open its second reply queue, and a frontend
start a thread, only in the second half).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from shmgate.gateway.images import _started_pool
from shmgate.shared.instance import Instance
from shmgate.shared.transport import PosixWorkerLink
from shmgate.shared.wire import Released
from tests.serving import Server
from tests.shm_children import scratch_instance


@pytest.fixture
def checksum_server(shared_checksum_server: Server) -> Server:
    """The checksum server this file shares with the others of its group (tests/conftest.py)."""
    return shared_checksum_server


def test_a_short_soak_of_hits_misses_and_bad_inputs_leaves_nothing_behind(checksum_server: Server) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "soak",
            "--base-url",
            checksum_server.base_url,
            "--server-pid",
            str(checksum_server.process.pid),
            "--requests",
            "300",
            "--warmup",
            "60",
            "--concurrency",
            "8",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.stdout.strip(), done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["problems"] == [] and done.returncode == 0
    outcomes = result["outcomes"]
    assert outcomes["hit:ok"] + outcomes["miss:ok"] + outcomes["bad:ok"] == 300
    assert result["after"]["held_bytes"] == 0
    assert {p["role"] for p in result["after"]["processes"]} >= {"supervisor", "frontend 0", "frontend 1", "worker"}


def test_a_timed_soak_reports_every_process_and_the_shared_memory_over_time(checksum_server: Server) -> None:
    """``--minutes``: memory sampled while the mix runs, with each series' slope over the last half."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "soak",
            "--base-url",
            checksum_server.base_url,
            "--server-pid",
            str(checksum_server.process.pid),
            "--minutes",
            "0.1",
            "--sample-s",
            "1",
            "--concurrency",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.stdout.strip(), done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["problems"] == [] and done.returncode == 0
    assert result["requests"] > 0 and set(result["outcomes"]) <= {"hit:ok", "miss:ok", "bad:ok"}
    series = {s["name"]: s for s in result["series"]}
    assert {"supervisor rss", "frontend 0 private", "frontend 1 rss", "/dev/shm mapped"} <= set(series)
    assert any(name.startswith("worker pid ") for name in series)
    assert series["/dev/shm mapped"]["last_mib"] > 0  # the arena and segment the processes map
    assert all(len(points) >= 3 for points in result["samples"].values())  # sampled along the way
    assert all(isinstance(s["slope_last_half_mib_per_min"], float) for s in series.values())


def test_the_slope_is_a_least_squares_fit() -> None:
    from bench.soak import slope_mib_per_min

    assert slope_mib_per_min([(0.0, 0.0), (60.0, 1024.0), (120.0, 2048.0)]) == 1.0  # 1 MiB a minute
    assert slope_mib_per_min([(0.0, 5.0), (30.0, 5.0)]) == 0.0
    assert slope_mib_per_min([(0.0, 5.0)]) == 0.0


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_worker_opens_every_frontends_reply_queue_when_it_claims_its_slot() -> None:
    with scratch_instance(arena_size=16 << 20, n_frontends=3, n_workers=1, queue_depth=2) as inst:
        link = PosixWorkerLink(Instance.attach(inst.names.instance_id))
        try:
            link.claim("checksum")
            claimed = _open_fds()
            for frontend_slot in range(3):
                link.send_reply(frontend_slot, Released(frontend_slot + 1), 1.0)
            assert _open_fds() == claimed
        finally:
            link.release()
            link.close()
            link.instance.close()


def test_a_started_pool_runs_all_its_threads_before_its_first_task() -> None:
    pool = _started_pool(3, "soak-probe")
    try:
        assert sum(t.name.startswith("soak-probe") for t in threading.enumerate()) == 3
        assert pool.submit(lambda: 7).result(5.0) == 7
    finally:
        pool.shutdown(wait=True)
