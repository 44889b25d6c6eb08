"""shared/parent_death.py with real processes: a parent that starts a child and dies, before and after the
child asked for its parent-death signal (the race the ``getppid`` check closes), and a child nobody
supervises."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.serving import wait_until

# The parent: starts the child with SHMGATE_SUPERVISOR_PID set to its own pid and prints the child's pid;
# then exits, at once or once the child has written its marker. The child waits ``delay`` s, calls
# follow_supervisor, writes the marker and sleeps: only the kernel's signal (parent died after the call)
# or the getppid check (parent died before it) can end it early.
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]],
                             env={**os.environ, "SHMGATE_SUPERVISOR_PID": str(os.getpid())})
    print(child.pid, flush=True)
    deadline = time.monotonic() + 10
    while sys.argv[2] and not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        time.sleep(0.02)
""")
CHILD = textwrap.dedent("""
    import sys, time
    time.sleep({delay})
    from shmgate.shared.parent_death import follow_supervisor
    follow_supervisor()
    open({marker!r}, "w").write("followed")
    time.sleep(30)
""")


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _run(tmp_path: Path, delay: float, *, parent_waits: bool) -> tuple[int, Path, str]:
    """Returns once the child is gone too: it holds the captured pipes. (pid, marker, the stderr of both)."""
    marker = tmp_path / "marker"
    repo = str(Path(__file__).parent.parent)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            PARENT,
            CHILD.format(delay=delay, marker=str(marker)),
            str(marker) if parent_waits else "",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": repo},
    )
    return int(done.stdout.strip()), marker, done.stderr


def test_a_child_whose_supervisor_died_before_it_asked_exits_at_once(tmp_path: Path) -> None:
    pid, marker, stderr = _run(tmp_path, delay=1.0, parent_waits=False)  # the parent is gone when the child asks
    try:
        wait_until(lambda: _exited(pid), 15, "the orphaned child exits")
    finally:
        if not _exited(pid):
            os.kill(pid, 9)
    assert not marker.exists()
    assert "is gone; exiting" in stderr, stderr


def test_a_child_that_asked_is_signalled_when_its_supervisor_dies(tmp_path: Path) -> None:
    pid, marker, stderr = _run(tmp_path, delay=0.0, parent_waits=True)  # the parent exits after the child asked
    try:
        wait_until(lambda: _exited(pid), 15, "the child exits when its parent does")
    finally:
        if not _exited(pid):
            os.kill(pid, 9)
    assert marker.exists(), stderr  # it got past follow_supervisor: the kernel's signal ended it


def test_a_child_nobody_supervises_is_not_affected(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(delay=0, marker=str(marker))],
        env={k: v for k, v in os.environ.items() if k != "SHMGATE_SUPERVISOR_PID"},
    )
    try:
        wait_until(marker.exists, 15, "the unsupervised child carries on")
        time.sleep(0.2)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
