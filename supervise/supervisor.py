"""The supervisor: owns the node's IPC objects and keeps frontends and workers running.

Modelled on uvicorn's multiprocess supervisor: signal handlers only record the
signal; a loop wakes every ``TICK_S``, stamps the instance heartbeat, drains the
signals and checks the children. Children are fresh interpreters (``python -m shmgate.gateway``,
``python -m shmgate.worker``, each with its configuration in its environment: node/serve.py), so the
supervisor knows processes, not HTTP or models.

A child that exits, whose heartbeat goes stale (frontends), or whose *progress*
stalls for longer than ``stall_timeout_s`` (any child: ``progress_ns`` in its
slot row is stamped only by the loop that does the work, see worker/health.py
and gateway/frontend.py Frontend._stamp_progress; a stepping worker with work
publishes a tighter bound from its recent step times, ``step_bound_ns``) is killed (SIGKILL: a wedged process may not
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
A child that dies ``EARLY_DEATHS_FATAL`` times in a row before it ever became
ready (its slot row READY) is treated the same way: a crash at start-up (a
device torch cannot use, a broken install) repeats on every restart, so
restarting it forever only hides the cause. The stop line quotes the child's
last stderr line: children's stderr passes through the supervisor (a thread per
child copies it on, line by line) so that line is at hand. Once a child has been
ready, a crash is restarted as before.

Children run in their own process groups and get ``SHMGATE_SUPERVISOR_PID``
(shared/parent_death.py). The first keeps a terminal's Ctrl-C, which signals
the whole foreground group, away from them: the supervisor alone gets it and
stops them in order, instead of every frontend raising KeyboardInterrupt at
once. The second makes them exit when the supervisor dies (even by SIGKILL),
rather than serving on with nobody to restart or stop them.

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
from typing import IO

from shmgate.shared.errors import EXIT_CONFIG, EXIT_USAGE
from shmgate.shared.instance import Instance
from shmgate.shared.parent_death import SUPERVISOR_PID_ENV
from shmgate.shared.transport import PosixSupervisorLink, Role, SupervisorLink
from shmgate.shared.vocabulary import DEAD_AFTER_S, InstanceState, SlotState

__all__ = ["ChildProcess", "Supervisor"]

log = logging.getLogger("shmgate.supervisor")

TICK_S = 0.2
# A frontend beats once its preprocessor is loaded; for hf:<dir> that imports transformers and
# torch, which took over 30 s on a busy 2-core machine (frontends were killed and restarted).
FRONTEND_STARTUP_GRACE_S = 90.0
# Deaths in a row before a child's first ready that stop ``serve``: one could be bad luck (OOM while
# loading), three of the same start-up is a configuration that will not work.
EARLY_DEATHS_FATAL = 3


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
    became_ready: bool = False  # this run reached READY in its slot row
    early_deaths: int = 0  # runs in a row that died before becoming ready
    last_stderr: str = ""  # the last non-empty line the current (or last) run wrote to stderr
    model: str = ""  # workers: the public id of the model it serves (several models on one node)
    ever_ready: bool = False  # some run of this child reached READY
    deaths: list[float] = field(default_factory=list)  # when its ready runs died, within the restart window
    given_up: bool = False  # died beyond the restart budget: not restarted again
    _stderr_pump: threading.Thread | None = None

    def start(self) -> None:
        env = {**self.env, SUPERVISOR_PID_ENV: str(os.getpid())}
        # process_group=0: a terminal's Ctrl-C (or a kill of the supervisor's group) reaches the
        # supervisor only, which stops the children in order (module docstring).
        self.process = subprocess.Popen(
            self.argv, env=env, pass_fds=self.pass_fds, process_group=0, stderr=subprocess.PIPE
        )
        self.started_at = time.monotonic()
        self.starts += 1
        self.became_ready = False
        self.last_stderr = ""
        assert self.process.stderr is not None
        self._stderr_pump = threading.Thread(
            target=self._pass_stderr, args=(self.process.stderr,), daemon=True, name=f"stderr-{self.role}-{self.slot}"
        )
        self._stderr_pump.start()
        log.info("started %s (pid %d)", self.name, self.process.pid)

    @property
    def name(self) -> str:
        """How logs name this child. A frontend's index is its slot; a worker's is not (it claims a free
        worker slot of the segment, the number its own log gives), so it is a "worker process"."""
        return f"frontend {self.slot}" if self.role == "frontend" else f"worker process {self.slot}"

    def last_words(self) -> str:
        """The last stderr line of a run that has exited (waits briefly for the copy to reach it)."""
        if self._stderr_pump is not None:
            self._stderr_pump.join(1.0)
        return self.last_stderr

    def _pass_stderr(self, stream: IO[bytes]) -> None:
        """Copy the child's stderr to ours line by line, remembering the last line for a fatal stop."""
        with stream:
            for line in stream:
                try:
                    view = memoryview(line)
                    while view:  # a signal can cut a write to a pipe short
                        view = view[os.write(2, view) :]
                except OSError:
                    pass  # our stderr is gone: keep draining, or the child blocks on a full pipe
                text = line.decode(errors="replace").strip()
                if text:
                    self.last_stderr = text

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
    """Starts the children, restarts or replaces the ones that die or stall, stops them in order.

    Its decisions read and write the instance only through ``link``, so they run over an in-memory
    link in unit tests (tests/test_supervisor_decisions.py); ``for_instance`` builds the real one.
    """

    link: SupervisorLink
    frontends: list[ChildProcess]
    workers: list[ChildProcess]
    # The POSIX instance whose IPC objects ``run`` unlinks at the end (None: nothing to unlink) and
    # whose header it reads for the served-model warnings.
    instance: Instance | None = None
    drain_timeout_s: float = 30.0
    # The first restart of a child that keeps failing waits this long, doubling with each failure.
    restart_backoff_s: float = 0.25
    # Called after each check of the children, in the supervisor's loop (node/startup_log.py:
    # "ready in N s" and the statistics line); it must return quickly.
    on_tick: Callable[[], None] | None = None
    # A worker that was ready and dies more than ``restart_budget`` times within ``restart_window_s`` is
    # not restarted again; when every worker of its model is given up, ``on_model_failed(model)`` marks
    # the model failed (its clients get 503, /v1/models says so) while the other models keep serving.
    # 0: restart for ever (one model: nothing else could serve meanwhile).
    restart_budget: int = 0
    restart_window_s: float = 300.0
    on_model_failed: Callable[[str], None] | None = None
    _signals: list[int] = field(default_factory=list)
    _force: bool = False
    _fatal: str = ""
    _warned_models: set[tuple[int, int]] = field(default_factory=set)  # (worker slot, epoch) already warned of
    _refused_seen: int = 0  # workers refused for another model, as last logged

    @classmethod
    def for_instance(
        cls,
        instance: Instance,
        frontends: list[ChildProcess],
        workers: list[ChildProcess],
        *,
        drain_timeout_s: float = 30.0,
        on_tick: Callable[[], None] | None = None,
    ) -> Supervisor:
        """The supervisor of a POSIX instance this process created (and unlinks when ``run`` ends)."""
        return cls(
            PosixSupervisorLink(instance),
            frontends,
            workers,
            instance=instance,
            drain_timeout_s=drain_timeout_s,
            on_tick=on_tick,
        )

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
                self.check_children()
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
            if self.instance is not None:
                self.instance.unlink()
                self.instance.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
            log.info("stopped; IPC objects unlinked")
        return EXIT_USAGE if self._fatal else 0  # serve exits 2 for a configuration it cannot run

    def _beat(self, stop: threading.Event) -> None:
        # A thread, so a slow tick (joining a child) never makes the instance look dead.
        while not stop.wait(TICK_S):
            self.link.beat()

    # -- checking -------------------------------------------------------------------

    def check_children(self) -> None:
        """One tick's decisions: start the children due a restart, replace the dead and the stalled."""
        now = time.monotonic()
        link = self.link
        for child in self.frontends + self.workers:
            if self._signals or self._fatal:
                return  # stopping: a child that exits now is not restarted (nor reported as a crash)
            if child.process is None:
                if now >= child.restart_at:
                    child.start()
                continue
            if child.is_alive():
                if not child.became_ready and self._slot_state(child) == SlotState.READY:
                    child.became_ready = child.ever_ready = True
                    child.early_deaths = 0
                    if child.role == "worker":
                        log.info(
                            "%s (pid %d) is ready in worker slot %s",
                            child.name,
                            child.pid,
                            link.slot_of(child.role, child.pid, child.slot),
                        )
                if child.role == "frontend" and now - child.started_at > FRONTEND_STARTUP_GRACE_S:
                    if not link.frontend_alive(child.slot):
                        log.error("frontend %d stopped beating; killing it", child.slot)
                        child.kill()
                        child.join(5)
                        self._after_death(child)
                        continue
                found = link.slot_of(child.role, child.pid, child.slot)
                if found is not None and link.stalled(child.role, found):
                    bound_s, by_steps = link.stall_bound_s(child.role, found)
                    if by_steps:  # a stepping engine with work, judged by its own recent step times
                        log.error(
                            "%s (pid %d) is wedged: it has work and made no step for %.1f s (its bound from "
                            "its recent step times; stall timeout %.1f s); killing it",
                            child.name,
                            child.pid,
                            bound_s,
                            self.stall_timeout_s,
                        )
                    else:
                        log.error("%s (pid %d) made no progress for %.1f s; killing it", child.name, child.pid, bound_s)
                    link.count_stall(child.role, found)
                    child.kill()
                    child.join(5)
                    self._after_death(child)
                continue
            if child.process is not None and child.process.returncode == EXIT_CONFIG:
                words = child.last_words().split("configuration error: ", 1)[-1]
                self._fatal = f"{child.name} failed on a configuration error" + (
                    f": {words}" if words else " (its reason is above)"
                )
                child.process = None
                return
            self._after_death(child)
        self._check_foreign_workers()
        self._check_worker_models()

    @property
    def stall_timeout_s(self) -> float:
        return self.link.stall_timeout_s()

    def _check_foreign_workers(self) -> None:
        """Workers we did not start (other containers): mark a stalled one DEAD; it exits on seeing that."""
        ours = {child.pid for child in self.workers if child.process is not None}
        for slot, pid in self.link.stalled_foreign_workers(ours):
            log.error(
                "worker slot %d (pid %d in another PID namespace or tree) made no progress for %.1f s; "
                "marking it dead (it exits when it sees that)",
                slot,
                pid,
                self.link.stall_bound_s("worker", slot)[0],
            )
            self.link.count_stall("worker", slot)
            self.link.mark_dead("worker", slot)

    def _slot_state(self, child: ChildProcess) -> int | None:
        """The state in ``child``'s slot row, None when no row carries its pid (not claimed yet)."""
        found = self.link.slot_of(child.role, child.pid, child.slot)
        if found is None:
            return None
        return self.link.slot_state(child.role, found)

    def _check_worker_models(self) -> None:
        """Warn of workers that serve another model than the gateway: refused ones, and ready ones (once each).

        Workers refuse to attach to a gateway of another model (worker/main.py) and note it in the header,
        so this log says it too; one that does not refuse (an older version, another container's) would
        count as ready while no request can reach it.
        """
        if self.instance is None:
            return  # the model check reads the POSIX header; an in-memory link has no other model
        seg = self.instance.segment
        served = seg.served_models
        if not served:
            return
        named = " or ".join(repr(m) for m in served)
        refused, model = seg.refused_workers()
        if refused != self._refused_seen:
            self._refused_seen = refused
            log.warning(
                "a worker serving %r refused to attach: this gateway serves %s (%d refused so far); "
                "start workers with the gateway's --model and --served-model-name",
                model,
                named,
                refused,
            )
        for slot in seg.live_workers(DEAD_AFTER_S):
            row = seg.workers[slot]
            model = bytes(row["model"]).decode(errors="replace")
            key = (slot, int(row["epoch"]))
            if model not in served and key not in self._warned_models:
                self._warned_models.add(key)
                log.warning(
                    "worker slot %d (pid %d) serves %r, not this gateway's %s: it gets no requests; "
                    "start it with the gateway's --model",
                    slot,
                    int(row["pid"]),
                    model,
                    named,
                )

    def _after_death(self, child: ChildProcess) -> None:
        assert child.process is not None
        code = child.process.returncode
        # A crash between two ticks leaves the row READY (or DRAINING): it was ready, too.
        if self._slot_state(child) in (SlotState.READY, SlotState.DRAINING):
            child.became_ready = child.ever_ready = True
        child.early_deaths = 0 if child.became_ready else child.early_deaths + 1
        if self._beyond_budget(child):
            return
        if child.early_deaths >= EARLY_DEATHS_FATAL:
            words = child.last_words()
            last = f": {words}" if words else ""
            self._fatal = (
                f"{child.name} exited {child.early_deaths} times in a row before it became "
                f"ready (last exit status {code}){last}"
            )
            self.link.mark_dead_by_pid(child.role, child.pid)
            child.process = None
            return
        log.error("%s (pid %d) exited with %s; restarting", child.name, child.pid, code)
        self.link.mark_dead_by_pid(child.role, child.pid)
        for _ in range(self.link.repair_locks()):
            log.warning("repaired a lock held by the dead %s", child.role)
        ran_s = time.monotonic() - child.started_at
        child.failures = 0 if ran_s > 30 else child.failures + 1
        backoff_s = self.restart_backoff_s * (2**child.failures) if child.failures else 0.0
        child.restart_at = time.monotonic() + min(30.0, backoff_s)
        child.process = None

    def _beyond_budget(self, child: ChildProcess) -> bool:
        """Give up a worker that served once and now dies beyond the restart budget; mark its model failed
        when none of the model's workers is left. True when given up (not restarted)."""
        if not self.restart_budget or child.role != "worker" or not child.ever_ready:
            return False
        now = time.monotonic()
        child.deaths = [t for t in child.deaths if now - t < self.restart_window_s] + [now]
        if len(child.deaths) <= self.restart_budget:
            return False
        assert child.process is not None
        log.error(
            "%s of model %r died %d times in %.0f s, beyond its restart budget of %d; not restarting it",
            child.name,
            child.model,
            len(child.deaths),
            self.restart_window_s,
            self.restart_budget,
        )
        self.link.mark_dead_by_pid(child.role, child.pid)
        child.given_up = True
        child.process = None
        child.restart_at = float("inf")
        if all(c.given_up for c in self.workers if c.model == child.model):
            log.error(
                "model %r failed: every worker of it died beyond its restart budget; the other models keep serving",
                child.model,
            )
            if self.on_model_failed is not None:
                self.on_model_failed(child.model)
        return True

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
