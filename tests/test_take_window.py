"""A worker in its own PID namespace (as in its own container) SIGKILLed while it holds a request it took off
the queue but had not yet claimed: the request is retried, not left to wait for its deadline.

This is `docker kill -s KILL` of a worker container under load, with local processes: `shmgate gateway`, one
worker attached by label, and one attached by label under `unshare --pid --fork` (so the gateway cannot see its
process: only heartbeats tell). The victim sleeps between taking a request and claiming it
(--diag-claim-delay-ms), so a SIGKILL lands in that window; before the fix the request it held waited for the
full request timeout and ended in a 504. Also: /ready and shmgate_workers_ready stop counting the killed worker
once its heartbeat is stale (nobody in its PID namespace can mark its row dead).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from shmgate.shared.instance import DEAD_AFTER_S
from tests.serving import expected_checksum, free_port, image_request, noise_png, wait_until
from tests.shm_children import leftovers

REQUEST_TIMEOUT_S = 30  # the gateway's deadline; a request lost in the window would wait this long
CLIENTS = 8
REQUESTS = 48
HANG_GUARD_S = 90
# The victim's take-to-claim window. Long, so the kill lands in it: with 300 ms a fresh-clone CI run once
# killed the victim between takes (it held nothing, so nothing was retried). Below TAKEN_UNCLAIMED_S (3 s),
# so a live victim is never retried for being slow: only the kill makes a retry.
CLAIM_DELAY_MS = 1500


def _can_unshare_pid() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=30).returncode == 0


pytestmark = pytest.mark.skipif(not _can_unshare_pid(), reason="needs root and unshare for a PID namespace")


def _metric(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def test_a_worker_killed_in_another_pid_namespace_before_claiming_loses_no_request(tmp_path: Path) -> None:
    port = free_port()
    label = f"take-window-{os.getpid()}-{port}"
    base_url = f"http://127.0.0.1:{port}"
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in ("gateway", "survivor", "victim")}
    worker = [
        sys.executable,
        "-m",
        "shmgate.worker",
        "--model",
        "checksum",
        "--label",
        label,
        "--device",
        "cpu",
        "--threads",
        "1",
        "--max-batch-size",
        "2",
    ]
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def log_tail() -> str:
        return "\n".join(f"--- {n}\n{(tmp_path / f'{n}.log').read_text()[-3000:]}" for n in logs)

    try:
        procs["gateway"] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shmgate.gateway",
                "gateway",
                "--port",
                str(port),
                "--label",
                label,
                "--model",
                "checksum",
                "--frontends",
                "1",
                "--arena-size",
                "64MiB",
                "--max-workers",
                "4",
                "--request-timeout-s",
                str(REQUEST_TIMEOUT_S),
            ],
            stdout=logs["gateway"],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs["survivor"] = subprocess.Popen(
            worker, stdout=logs["survivor"], stderr=subprocess.STDOUT, start_new_session=True
        )
        procs["victim"] = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--kill-child", *worker, "--diag-claim-delay-ms", str(CLAIM_DELAY_MS)],
            stdout=logs["victim"],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def workers_ready() -> float:
            try:
                return _metric(base_url, "shmgate_workers_ready")
            except httpx.HTTPError:
                return 0

        wait_until(lambda: workers_ready() == 2, 60, "two workers ready\n" + log_tail())

        images = [noise_png(seed) for seed in range(6)]
        outcomes: list[tuple[int, float, bool]] = []
        done = threading.Semaphore(0)

        def one(i: int) -> None:
            data = images[i % len(images)]
            started = time.monotonic()
            try:
                r = httpx.post(
                    base_url + "/v1/chat/completions",
                    json=image_request("checksum", data),
                    timeout=REQUEST_TIMEOUT_S + 15,
                )
                ok = r.status_code == 200 and expected_checksum(data) in r.text
                outcomes.append((r.status_code, time.monotonic() - started, ok))
            except httpx.HTTPError:
                outcomes.append((0, time.monotonic() - started, False))
            done.release()

        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(one, i) for i in range(REQUESTS)]
            for _ in range(12):  # under load: the victim now spends most of its time in the take window
                assert done.acquire(timeout=HANG_GUARD_S)
            victim_pids = _children(procs["victim"].pid)  # the worker: PID 1 of its namespace
            assert victim_pids, "the worker under unshare is not running\n" + log_tail()
            for pid in victim_pids:
                os.kill(pid, signal.SIGKILL)
            for f in futures:
                f.result(timeout=HANG_GUARD_S)

        failed = [(status, round(took, 1)) for status, took, ok in outcomes if not ok]
        assert not failed, f"{len(failed)} of {REQUESTS} requests failed (status, s): {failed}\n{log_tail()}"
        # Retried, not waited out: a lost request would have taken the whole deadline.
        slowest = max(took for _, took, _ in outcomes)
        assert slowest < REQUEST_TIMEOUT_S, f"a request waited {slowest:.1f} s, i.e. for its deadline"
        assert _metric(base_url, "shmgate_retries_total") >= 1, log_tail()
        # The killed worker's row still says READY (no one in its PID namespace marked it): its stale heartbeat
        # takes it out of the count, and /ready stays 200 on the survivor.
        wait_until(lambda: workers_ready() == 1, DEAD_AFTER_S + 5, "workers_ready drops the killed worker")
        assert httpx.get(base_url + "/ready", timeout=5).status_code == 200
        procs["survivor"].terminate()
        assert procs["survivor"].wait(30) == 0
        wait_until(
            lambda: httpx.get(base_url + "/ready", timeout=5).status_code == 503,
            DEAD_AFTER_S + 5,
            "/ready turns 503 without workers",
        )
        procs["gateway"].terminate()
        assert procs["gateway"].wait(30) == 0, log_tail()
        instance_id = next(
            line.split("instance ", 1)[1].split()[0]
            for line in (tmp_path / "gateway.log").read_text().splitlines()
            if " listening on " in line
        )
        assert leftovers(instance_id, slots=4) == []
    finally:
        # Each tree in its own session: a failed run kills the gateway's frontends too. Left running, they
        # would keep the instance's queues open, and their memory charged to this uid's RLIMIT_MSGQUEUE.
        for proc in procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
        for f in logs.values():
            f.close()
