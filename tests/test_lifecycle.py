"""How a real ``shmgate serve`` ends: a terminal's Ctrl-C, a SIGTERM to its whole process group, and the
SIGKILL of its supervisor under load.

A terminal signals every process of its foreground group; the children run in their own groups
(supervise/supervisor.py) so that only the supervisor gets it and stops them in order: no
KeyboardInterrupt tracebacks from the frontends, and no "restarting" of children that are exiting.
When the supervisor is killed outright, its children get SIGTERM from the kernel (shared/parent_death.py)
instead of serving on with nobody to stop them; ``shmgate cleanup`` then removes the IPC objects.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serving import Server, expected_checksum, free_port, image_request, noise_png, wait_until
from tests.shm_children import leftovers

GUARD_S = 60.0


def _start_in_own_group(tmp_path: Path, *extra: str) -> Server:
    """``shmgate serve`` (checksum, 2 frontends, 1 worker) as the leader of its own process group."""
    port = free_port()
    log_path = tmp_path / f"serve-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shmgate.gateway",
                "serve",
                "--port",
                str(port),
                "--model",
                "checksum",
                "--frontends",
                "2",
                "--workers",
                "1",
                "--arena-size",
                "64MiB",
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(process, port, "checksum", log_path)
    try:
        server.wait_ready()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):  # the group may be gone already (an early exit)
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    return server


def _gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by its new parent counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _kill_all(server: Server, children: list[int]) -> None:
    """SIGKILL whatever of the server is still running (its group, and children in groups of their own)."""
    for pid in [server.process.pid, *children]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.process.wait(10)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "group-sigterm"])
def test_a_signal_to_the_whole_process_group_stops_serve_cleanly(tmp_path: Path, signum: int) -> None:
    server = _start_in_own_group(tmp_path)
    children = [pid for pid, _ in server.children()]
    try:
        instance_id = server.instance_id
        assert len(children) == 3, server.children()
        own_groups = all(os.getpgid(pid) != server.process.pid for pid in children)
        started = time.monotonic()
        os.killpg(server.process.pid, signum)  # what a terminal's Ctrl-C (or `kill -TERM -PGID`) does
        code = server.process.wait(GUARD_S)
        took_s = time.monotonic() - started
        wait_until(lambda: all(_gone(pid) for pid in children), 10, "the children exit with the supervisor")
    finally:
        _kill_all(server, children)  # never leave a server behind, even when the test failed
    log = server.log_path.read_text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert "restarting" not in log, log[-3000:]
    assert "KeyboardInterrupt" not in log, log[-3000:]
    assert own_groups, "the children were in the supervisor's group: a terminal's Ctrl-C reaches them too"
    assert not leftovers(instance_id, slots=64)
    print(f"\n{signal.Signals(signum).name} to the group: serve exited 0 in {took_s:.1f} s")


# serial: its dead instance must survive until its own `shmgate cleanup`, which removes every dead instance
# on the machine; a serve starting beside it would remove it first.
@pytest.mark.serial
def test_children_exit_when_their_supervisor_is_sigkilled_under_load(tmp_path: Path) -> None:
    server = _start_in_own_group(tmp_path)
    instance_id = server.instance_id
    children = [pid for pid, _ in server.children()]
    commands = dict(server.children())
    image = noise_png(7)
    answered = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                try:
                    r = client.post(server.base_url + "/v1/chat/completions", json=image_request("checksum", image))
                    answered.append(r.status_code == 200 and expected_checksum(image) in r.text)
                except httpx.HTTPError:
                    answered.append(False)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: sum(answered) >= 8, GUARD_S, "the load is being served")
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(10)
        try:
            took_s = wait_until(
                lambda: all(_gone(pid) for pid in children), 10, "every child exits after its supervisor was SIGKILLed"
            )
        except AssertionError:
            raise AssertionError(f"left: {[commands[pid] for pid in children if not _gone(pid)]}") from None
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        _kill_all(server, children)  # never leave them behind, even when the test failed
    print(f"\nsupervisor SIGKILLed under load: all {len(children)} children gone {took_s:.1f} s later")
    done = subprocess.run(
        [sys.executable, "-m", "shmgate.gateway", "cleanup"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert instance_id in done.stdout, done.stdout
    assert not leftovers(instance_id, slots=64)  # /dev/shm entries and queues (probed by name)
