"""The soak (bench/soak.py), short: a few hundred mixed requests leave nothing behind.

The full run (20,000 requests) is a benchmark; its figures are in docs/RELIABILITY.md. The soak
calls any growth of a process's descriptors or threads in the timed run's second half a leak, so
the server keeps them fixed at rest whatever its load history: the unit tests below pin the parts
that used to grow on first use (CI once saw a worker open its second reply queue, and a frontend
start a thread, only in the second half).
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from bench import soak
from shmgate.gateway.images import _started_pool
from shmgate.shared.instance import Instance
from shmgate.shared.transport import PosixWorkerLink
from shmgate.shared.wire import Released
from tests.serving import Server
from tests.shm_children import scratch_instance


def test_a_short_soak_of_hits_misses_and_bad_inputs_leaves_nothing_behind(
    checksum_server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    code = soak.main(
        [
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
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert result["problems"] == [] and code == 0
    outcomes = result["outcomes"]
    assert outcomes["hit:ok"] + outcomes["miss:ok"] + outcomes["bad:ok"] == 300
    assert result["after"]["held_bytes"] == 0
    assert {p["role"] for p in result["after"]["processes"]} >= {"supervisor", "frontend 0", "frontend 1", "worker"}


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
