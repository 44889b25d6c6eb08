"""The supervisor's decisions over an in-memory SupervisorLink, with real (tiny) child processes.

The children are ``sh`` processes that sleep or exit; the test plays their slot rows (READY,
stalled) through ``MemorySupervisorLink``, so each decision (restart with backoff, stop on
repeated early deaths, replace a stalled child, leave children alone while stopping) is checked
in well under a second, without shared memory or ``shmgate serve``. tests/test_selfheal.py and
tests/test_lifecycle.py check the same paths end to end with real frontends and workers.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from shmgate.shared.errors import EXIT_CONFIG
from shmgate.shared.transport.base import Role
from shmgate.shared.transport.memory import MemorySupervisorLink
from shmgate.shared.vocabulary import InstanceState, SlotState
from shmgate.supervise.supervisor import ChildProcess, Supervisor, child_env

SLEEPER = ["sh", "-c", "exec sleep 30"]


def _child(argv: list[str], role: Role = "worker", slot: int = 0) -> ChildProcess:
    return ChildProcess(role, slot, argv, child_env())


@pytest.fixture
def children() -> Iterator[list[ChildProcess]]:
    """Every child a test makes; whatever is still running at the end is killed."""
    made: list[ChildProcess] = []
    yield made
    for child in made:
        child.kill()
        child.join(5)


def _crash(child: ChildProcess) -> None:
    """The child dies by itself (as a segfault would): SIGKILL from outside, reaped before the next tick."""
    assert child.process is not None
    os.kill(child.pid, signal.SIGKILL)
    child.process.wait(5)


def test_a_dead_child_is_restarted_after_a_backoff_that_doubles(children: list[ChildProcess]) -> None:
    link = MemorySupervisorLink()
    worker = _child(SLEEPER)
    children.append(worker)
    sup = Supervisor(link, [], [worker], restart_backoff_s=0.05)
    worker.start()
    first_pid = worker.pid
    row = link.claim("worker", 3, first_pid)
    sup.check_children()
    assert worker.became_ready

    _crash(worker)
    sup.check_children()
    assert worker.process is None and row.state == SlotState.DEAD  # frontends retry its requests at once
    assert 0.0 < worker.restart_at - time.monotonic() <= 0.1  # 0.05 s x 2: its first failure
    sup.check_children()
    assert worker.process is None, "restarted before its backoff ran out"

    deadline = time.monotonic() + 5
    while worker.process is None and time.monotonic() < deadline:
        time.sleep(0.01)
        sup.check_children()
    assert worker.is_alive() and worker.pid != first_pid and worker.starts == 2

    _crash(worker)  # again, soon after: the wait doubles
    sup.check_children()
    assert 0.1 < worker.restart_at - time.monotonic() <= 0.2


def test_dead_before_ready_three_times_stops_everything(children: list[ChildProcess]) -> None:
    link = MemorySupervisorLink()
    broken = _child(["sh", "-c", "echo 'RuntimeError: no CUDA device' >&2; exit 1"])
    children.append(broken)
    sup = Supervisor(link, [], [broken], restart_backoff_s=0.0)
    broken.start()
    deadline = time.monotonic() + 10
    while not sup._fatal and time.monotonic() < deadline:
        time.sleep(0.01)
        sup.check_children()
    assert broken.starts == 3 and broken.early_deaths == 3 and broken.process is None  # not started a 4th time
    assert "exited 3 times in a row before it became ready" in sup._fatal
    assert "no CUDA device" in sup._fatal  # the child's last stderr line, for the operator
    sup.check_children()
    assert broken.starts == 3


def test_a_configuration_error_stops_serve_at_once_with_status_2(children: list[ChildProcess]) -> None:
    link = MemorySupervisorLink()
    worker = _child(["sh", "-c", f"echo 'configuration error: unknown model x' >&2; exit {EXIT_CONFIG}"])
    healthy = _child(SLEEPER, role="frontend")
    children.extend([worker, healthy])
    sup = Supervisor(link, [healthy], [worker])

    assert sup.run() == 2
    assert worker.starts == 1  # no restart: it would fail the same way
    assert not healthy.is_alive()  # everything stopped
    assert link.instance_states[-1] == InstanceState.STOPPED
    assert sup._fatal.endswith("failed on a configuration error: unknown model x")


def test_a_child_that_was_ready_is_restarted_however_often_it_dies(children: list[ChildProcess]) -> None:
    link = MemorySupervisorLink()
    worker = _child(SLEEPER)
    children.append(worker)
    sup = Supervisor(link, [], [worker], restart_backoff_s=0.0)
    worker.start()
    for _ in range(4):
        link.claim("worker", 0, worker.pid)
        sup.check_children()
        _crash(worker)
        sup.check_children()  # reaped: restart due now (no backoff)
        sup.check_children()  # restarted
        assert worker.is_alive()
    assert not sup._fatal and worker.starts == 5


def test_a_stalled_child_is_killed_counted_and_replaced(children: list[ChildProcess]) -> None:
    link = MemorySupervisorLink(stall_timeout_s=5.0)
    worker = _child(SLEEPER)
    children.append(worker)
    sup = Supervisor(link, [], [worker], restart_backoff_s=0.0)
    worker.start()
    process = worker.process
    assert process is not None
    row = link.claim("worker", 1, worker.pid)
    sup.check_children()
    assert worker.is_alive() and row.stalls == 0  # progressing: left alone

    row.stalled = True  # its progress stamp stopped while its heartbeat went on
    sup.check_children()
    assert process.returncode == -signal.SIGKILL  # a wedged process may not honour SIGTERM
    assert row.stalls == 1 and row.state == SlotState.DEAD
    sup.check_children()
    assert worker.is_alive() and worker.process is not process and worker.starts == 2


def test_a_stalled_worker_of_another_container_is_marked_dead_not_signalled(children: list[ChildProcess]) -> None:
    link = MemorySupervisorLink(stall_timeout_s=5.0)
    sup = Supervisor(link, [], [])
    foreign = link.claim("worker", 2, pid=999_999_999)  # not ours: its pid means nothing here
    foreign.stalled = True
    sup.check_children()
    assert foreign.state == SlotState.DEAD and foreign.stalls == 1


def test_no_restart_while_stopping(children: list[ChildProcess]) -> None:
    link = MemorySupervisorLink()
    worker = _child(SLEEPER)
    children.append(worker)
    sup = Supervisor(link, [], [worker], restart_backoff_s=0.0)
    worker.start()
    row = link.claim("worker", 0, worker.pid)
    sup.check_children()

    sup._on_signal(signal.SIGTERM, None)  # what the handler records when SIGTERM arrives
    _crash(worker)  # a child exiting now is part of the stop, not a crash
    sup.check_children()
    sup.check_children()
    assert worker.process is not None and worker.starts == 1
    assert row.state == SlotState.READY  # not marked DEAD, not reported


def test_the_drain_waits_for_busy_frontends_then_stops_in_order(children: list[ChildProcess]) -> None:
    link = MemorySupervisorLink()
    frontend = _child(SLEEPER, role="frontend")
    worker = _child(SLEEPER)
    children.extend([frontend, worker])
    stopped_states: list[list[InstanceState]] = []

    def on_tick() -> None:
        if frontend.is_alive() and not stopped_states:
            link.claim("frontend", 0, frontend.pid).busy = False
            stopped_states.append([])
            signal.raise_signal(signal.SIGTERM)

    sup = Supervisor(link, [frontend], [worker], drain_timeout_s=5.0, on_tick=on_tick)
    assert sup.run() == 0
    assert link.instance_states == [InstanceState.DRAINING, InstanceState.DRAINED, InstanceState.STOPPED]
    assert frontend.process is not None and frontend.process.returncode == -signal.SIGTERM  # asked, not killed
    assert worker.process is not None and worker.process.returncode == -signal.SIGTERM
    assert frontend.starts == 1 and worker.starts == 1
