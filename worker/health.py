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
import time
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

    The bound is ``max(floor_s, factor x p99, slowest_factor x slowest)``: the p99 over the last ``window``
    steps, the slowest over a longer memory (its weight halves every ``slowest_half_life_s``, so a
    large image's prefill ten minutes ago still counts, one an hour ago hardly). Published
    (``publish``: ns into the slot row's ``step_bound_ns``) only once ``min_steps`` steps were seen
    and only while the engine has work; 0 otherwise (the stall timeout alone applies: idle, loading,
    or work that is not a step, like compiling a grammar). Why both terms: a VLM's steps are mostly
    short decodes with a rare long prefill, too rare for the p99 of a few hundred steps; judged by its
    decodes alone, a healthy worker's next large prefill would read as a wedge. The floor covers a
    first large prefill on a fast device; on CPU, where one can take seconds, the slowest-step term
    is what protects it after the first.
    """

    def __init__(
        self,
        publish: Callable[[int], None],
        *,
        floor_s: float = 5.0,
        factor: float = 20.0,
        slowest_factor: float = 4.0,
        slowest_half_life_s: float = 600.0,
        window: int = 256,
        min_steps: int = 16,
    ) -> None:
        self._publish = publish
        self._floor_s = floor_s
        self._factor = factor
        self._slowest_factor = slowest_factor
        self._half_life_s = slowest_half_life_s
        self._min_steps = min_steps
        self._steps = 0
        self._recent: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []  # the same values, sorted (the p99 without a sort per step)
        self._slowest = (0.0, 0.0)  # (seconds, when: monotonic) of the slowest step, before its decay
        self._published = -1.0

    def note_step(self, seconds: float) -> None:
        """One step of the engine took ``seconds`` (what the engine, or the loop around it, calls per step)."""
        if len(self._recent) == self._recent.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._recent[0])]
        self._recent.append(seconds)
        bisect.insort(self._sorted, seconds)
        self._steps += 1
        now = time.monotonic()
        if seconds >= self._slowest_now(now):
            self._slowest = (seconds, now)

    def _slowest_now(self, now: float) -> float:
        seconds, when = self._slowest
        return seconds * 0.5 ** ((now - when) / self._half_life_s)

    def bound_s(self) -> float:
        """The stall bound now, in seconds; 0.0 until ``min_steps`` steps were seen."""
        ordered = self._sorted
        if self._steps < self._min_steps:
            return 0.0
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        slowest = self._slowest_now(time.monotonic())
        return max(self._floor_s, self._factor * p99, self._slowest_factor * slowest)

    def busy(self) -> None:
        """The engine has work: a step is due, so no step within the bound means it is wedged."""
        self._set(round(self.bound_s(), 1))

    def idle(self) -> None:
        """No step is due (idle, or doing other work that takes its own time): the stall timeout applies."""
        self._set(0.0)

    def _set(self, seconds: float) -> None:
        if seconds != self._published:  # one store when it changes (to a tenth of a second), not per step
            self._published = seconds
            self._publish(int(seconds * 1e9))
