"""The worker's own view of its health: progress stamps and errors it cannot carry on after.

Who uses this: worker/main.py. Two signals live in the worker's slot row:
``beat_ns`` (a heartbeat thread: "the process exists") and ``progress_ns``
(stamped here, only by the loops that do the work: "the process is getting
somewhere"). The supervisor compares ``progress_ns`` with ``--stall-timeout-s``
(supervise/supervisor.py); a heartbeat alone would keep a deadlocked model loop
looking alive forever.

A stepping engine (a generation engine: many short steps) also publishes ``step_bound_ns`` while it
has work (``StepClock``): a bound on the time without a progress stamp, derived from its recent step
times, so a wedged worker (SIGSTOP, a hung forward pass) is replaced seconds after its last step
instead of after the stall timeout, which has to cover the slowest batch of any model.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable

from shmgate.shared.vocabulary import now_ns

__all__ = ["Progress", "StepClock", "is_sticky_device_error"]

# Messages of errors after which a CUDA context is unusable: every later kernel fails too.
# torch raises them as RuntimeError (or torch.AcceleratorError, a RuntimeError subclass).
_STICKY_MARKERS = (
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
)


def is_sticky_device_error(exc: BaseException) -> bool:
    """Is ``exc`` a device error that will fail every later batch too (so the worker must restart)?"""
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _STICKY_MARKERS)


class Progress:
    """Stamps one worker row's ``progress_ns``. Cheap (one store): called per event and per decode step.

    ``blocked_since_ns`` covers the prefetch thread: while it is inside a device copy, the main
    loop's idle turns do not count as progress past the moment the copy began (a hung copy must
    read as a stall, not be hidden by an idle main loop).
    """

    def __init__(self, stamp: Callable[[int], None]) -> None:
        """``stamp``: stores a progress time (ns) in this worker's slot (``WorkerLink.progress_stamper``)."""
        self._stamp = stamp
        self.blocked_since_ns = 0

    def step(self) -> None:
        """The model made a step (a batch, an event, a decode step)."""
        self._stamp(now_ns())

    def idle_turn(self) -> None:
        """The main loop turned without work: progress unless the prefetch thread is stuck in a copy."""
        now = now_ns()
        blocked = self.blocked_since_ns
        self._stamp(min(now, blocked) if blocked else now)


class StepClock:
    """A stepping engine's recent step times, and the stall bound they give while it has work.

    The bound is ``max(floor_s, factor x p99, slowest_factor x the slowest recent step)`` over the last
    ``window`` steps, published (``publish``: ns into the slot row's ``step_bound_ns``) only once
    ``min_steps`` steps were seen and only while the engine has work; 0 otherwise (the stall timeout alone
    applies: idle, loading, or work that is not a step, like compiling a grammar). The slowest-step term
    keeps a worker whose steps are usually short but sometimes long (a large image's prefill among
    decode steps) from being judged by its short ones.
    """

    def __init__(
        self,
        publish: Callable[[int], None],
        *,
        floor_s: float = 2.0,
        factor: float = 20.0,
        slowest_factor: float = 4.0,
        window: int = 256,
        min_steps: int = 16,
    ) -> None:
        self._publish = publish
        self._floor_s = floor_s
        self._factor = factor
        self._slowest_factor = slowest_factor
        self._min_steps = min_steps
        self._recent: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []  # the same values, sorted (p99 and max without a sort per step)
        self._published = -1

    def note_step(self, seconds: float) -> None:
        """One step of the engine took ``seconds`` (what the engine, or the loop around it, calls per step)."""
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._recent.append(seconds)
        bisect.insort(self._sorted, seconds)

    def bound_s(self) -> float:
        """The stall bound now, in seconds; 0.0 until ``min_steps`` steps were seen."""
        ordered = self._sorted
        if len(ordered) < self._min_steps:
            return 0.0
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return max(self._floor_s, self._factor * p99, self._slowest_factor * ordered[-1])

    def busy(self) -> None:
        """The engine has work: a step is due, so no step within the bound means it is wedged."""
        self._set(int(self.bound_s() * 1e9))

    def idle(self) -> None:
        """No step is due (idle, or doing other work that takes its own time): the stall timeout applies."""
        self._set(0)

    def _set(self, ns: int) -> None:
        if ns != self._published:  # one store when it changes, not per step
            self._published = ns
            self._publish(ns)
