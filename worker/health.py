"""The worker's own view of its health: progress stamps and errors it cannot carry on after.

Who uses this: worker/main.py. Two signals live in the worker's slot row:
``beat_ns`` (a heartbeat thread: "the process exists") and ``progress_ns``
(stamped here, only by the loops that do the work: "the process is getting
somewhere"). The supervisor compares ``progress_ns`` with ``--stall-timeout-s``
(supervise/supervisor.py); a heartbeat alone would keep a deadlocked model loop
looking alive forever.
"""

from __future__ import annotations

from collections.abc import Callable

from shmgate.shared.vocabulary import now_ns

__all__ = ["Progress", "is_sticky_device_error"]

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
