"""The supervisor: owns the node's IPC objects and keeps frontends and workers running.

Modelled on uvicorn's multiprocess supervisor: signal handlers only record the
signal; a loop wakes every ``TICK_S``, stamps the instance heartbeat, drains the
signals and checks the children. Children are fresh interpreters running the
same commands docker compose runs (``python -m gateway frontend ...``,
``python -m worker ...``), so the supervisor knows processes, not HTTP or models.

A child that exits, whose heartbeat goes stale (frontends), or whose *progress*
stalls for longer than ``stall_timeout_s`` (any child: ``progress_ns`` in its
slot row is stamped only by the loop that does the work, see worker/health.py
and gateway/frontend.py Frontend._stamp_progress) is killed (SIGKILL: a wedged process may not
honour SIGTERM), joined, marked DEAD in its slot row (so frontends retry its
claimed requests at once instead of waiting for the heartbeat to age) and the
locks it may have held are repaired; then it is restarted in its slot with an
exponential backoff. A worker this supervisor did not start (attached by label
from another container) cannot be signalled: when it stalls its row is marked
DEAD, and the worker's heartbeat thread exits the process when it sees that
(worker/main.py), so its container's restart policy replaces it.

A child that exits with ``EXIT_CONFIG`` failed on its configuration (an unknown
model, a missing model directory): restarting cannot help, so the supervisor
stops everything and ``run`` returns 2, the reason being on the child's stderr.

Shutdown (SIGTERM, or the first SIGINT): the instance is marked DRAINING (new
requests get 503 with Retry-After, /ready turns 503) while the frontends keep
accepting until their in-flight requests have ended (or the drain timeout):
uvicorn stops accepting and closes idle keep-alive connections as soon as it gets
SIGTERM, so signalling it first would turn "503, retry elsewhere" into dropped
connections. Then frontends get SIGTERM and finish sending what they have
(uvicorn's graceful shutdown), then workers get SIGTERM, then anything left is
killed, and in a ``finally`` every IPC object is unlinked.
A second SIGINT skips the drain.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.errors import EXIT_CONFIG
from shared.instance import Instance
from shared.transport import PosixSupervisorLink, Role
from shared.vocabulary import InstanceState

__all__ = ["ChildProcess", "Supervisor"]

log = logging.getLogger("shmgate.supervisor")

TICK_S = 0.2
STARTUP_GRACE_S = 120.0  # a worker loading a large model may not beat its slot for a while
# A frontend beats once its preprocessor is loaded; for hf:<dir> that imports transformers and
# torch, which took over 30 s on a busy 2-core machine (frontends were killed and restarted).
FRONTEND_STARTUP_GRACE_S = 90.0


@dataclass
class ChildProcess:
    """One child in one slot: how to start it, and its current process."""

    role: Role
    slot: int
    argv: list[str]
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    failures: int = 0
    restart_at: float = 0.0
    starts: int = 0

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, env=self.env, pass_fds=self.pass_fds)
        self.started_at = time.monotonic()
        self.starts += 1
        log.info("started %s %d (pid %d)", self.role, self.slot, self.process.pid)

    @property
    def pid(self) -> int:
        return self.process.pid if self.process else 0

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def terminate(self) -> None:
        if self.is_alive():
            assert self.process is not None
            self.process.terminate()

    def kill(self) -> None:
        if self.is_alive():
            assert self.process is not None
            self.process.kill()

    def join(self, timeout_s: float) -> bool:
        if self.process is None:
            return True
        try:
            self.process.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False


@dataclass
class Supervisor:
    instance: Instance
    frontends: list[ChildProcess]
    workers: list[ChildProcess]
    drain_timeout_s: float = 30.0
    # Called after each check of the children, in the supervisor's loop (gateway/startup_log.py:
    # "ready in N s" and the statistics line); it must return quickly.
    on_tick: Callable[[], None] | None = None
    _signals: list[int] = field(default_factory=list)
    _force: bool = False
    _fatal: str = ""
    link: PosixSupervisorLink = field(init=False)

    def __post_init__(self) -> None:
        self.link = PosixSupervisorLink(self.instance)

    # -- signals --------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT and self._signals:
            self._force = True
        self._signals.append(signum)

    def run(self) -> int:
        """Start the children and supervise until a signal asks to stop; always unlinks.

        Returns 0, or 2 when a child failed on a configuration error.
        """
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        beat_stop = threading.Event()
        beat = threading.Thread(target=self._beat, args=(beat_stop,), daemon=True)
        beat.start()
        try:
            for child in self.frontends + self.workers:
                child.start()
            while not self._signals and not self._fatal:
                time.sleep(TICK_S)
                self._check_children()
                if self.on_tick is not None and not self._fatal:
                    self.on_tick()
            if self._fatal:
                log.error("stopping: %s", self._fatal)
                self._force = True
            else:
                log.info("shutting down (signal %d)", self._signals[0])
            self._shutdown()
        finally:
            beat_stop.set()
            for child in self.frontends + self.workers:
                child.kill()
                child.join(5)
            self.link.mark_instance(InstanceState.STOPPED)
            self.instance.unlink()
            self.instance.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
            log.info("stopped; IPC objects unlinked")
        return 2 if self._fatal else 0

    def _beat(self, stop: threading.Event) -> None:
        # A thread, so a slow tick (joining a child) never makes the instance look dead.
        while not stop.wait(TICK_S):
            self.link.beat()

    # -- checking -------------------------------------------------------------------

    def _check_children(self) -> None:
        now = time.monotonic()
        link = self.link
        for child in self.frontends + self.workers:
            if child.process is None:
                if now >= child.restart_at:
                    child.start()
                continue
            if child.is_alive():
                if child.role == "frontend" and now - child.started_at > FRONTEND_STARTUP_GRACE_S:
                    if not link.frontend_alive(child.slot):
                        log.error("frontend %d stopped beating; killing it", child.slot)
                        child.kill()
                        child.join(5)
                        self._after_death(child)
                        continue
                found = link.slot_of(child.role, child.pid, child.slot)
                if found is not None and link.stalled(child.role, found):
                    log.error("%s %d (pid %d) made no progress for %.1f s; killing it", child.role, child.slot,
                              child.pid, self.stall_timeout_s)
                    link.count_stall(child.role, found)
                    child.kill()
                    child.join(5)
                    self._after_death(child)
                continue
            if child.process is not None and child.process.returncode == EXIT_CONFIG:
                self._fatal = f"{child.role} {child.slot} failed on a configuration error (its reason is above)"
                child.process = None
                return
            self._after_death(child)
        self._check_foreign_workers()

    @property
    def stall_timeout_s(self) -> float:
        return self.link.stall_timeout_s()

    def _check_foreign_workers(self) -> None:
        """Workers we did not start (other containers): mark a stalled one DEAD; it exits on seeing that."""
        ours = {child.pid for child in self.workers if child.process is not None}
        for slot, pid in self.link.stalled_foreign_workers(ours):
            log.error("worker slot %d (pid %d in another PID namespace or tree) made no progress for %.1f s; "
                      "marking it dead (it exits when it sees that)", slot, pid, self.stall_timeout_s)
            self.link.count_stall("worker", slot)
            self.link.mark_dead("worker", slot)

    def _after_death(self, child: ChildProcess) -> None:
        assert child.process is not None
        code = child.process.returncode
        log.error("%s %d (pid %d) exited with %s; restarting", child.role, child.slot, child.pid, code)
        self.link.mark_dead_by_pid(child.role, child.pid)
        for _ in range(self.link.repair_locks()):
            log.warning("repaired a lock held by the dead %s", child.role)
        ran_s = time.monotonic() - child.started_at
        child.failures = 0 if ran_s > 30 else child.failures + 1
        child.restart_at = time.monotonic() + min(30.0, 0.25 * (2**child.failures) if child.failures else 0.0)
        child.process = None

    # -- shutdown -------------------------------------------------------------------

    def _shutdown(self) -> None:
        self.link.mark_instance(InstanceState.DRAINING)
        if not self._force:
            deadline = time.monotonic() + self.drain_timeout_s
            self._wait_in_flight(deadline)
        # Workers in other containers that follow the drain (worker/drain.py) exit on this.
        self.link.mark_instance(InstanceState.DRAINED)
        if not self._force:
            self._stop_group(self.frontends, max(1.0, deadline - time.monotonic()))
        self._stop_group(self.workers, 0.0 if self._force else 10.0)

    def _wait_in_flight(self, deadline: float) -> None:
        """Until no live frontend has a request in flight (they answer new ones 503 meanwhile).

        Requests still decoding their images count too (``preparing``: admitted, not yet in
        IN_FLIGHT): stopping their frontend would cancel the decode and answer 500, and workers
        that follow the drain would be gone before those requests reach the queue. Quiet must
        hold on two polls in a row: a frontend that passed its draining check just before the
        state changed publishes ``preparing`` a moment later.
        """
        quiet = 0
        while time.monotonic() < deadline and not self._force:
            slots = [child.slot for child in self.frontends if child.is_alive()]
            busy = any(self.link.frontend_busy(slot) for slot in slots)
            quiet = 0 if busy else quiet + 1
            if quiet >= 2:
                return
            time.sleep(TICK_S / 4)

    def _stop_group(self, children: Sequence[ChildProcess], timeout_s: float) -> None:
        for child in children:
            child.terminate()
        deadline = time.monotonic() + timeout_s
        for child in children:
            if not child.join(max(0.0, deadline - time.monotonic())) or self._force:
                child.kill()
                child.join(5)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    return env
