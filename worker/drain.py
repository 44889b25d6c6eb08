"""A worker's stop request, following the gateway's drain when asked to.

Why: the kubelet sends SIGTERM to every container of a pod at once (after each one's preStop
hook). A worker that stopped at once would leave the gateway draining with no one to run the
requests it still holds, and the ones a load balancer sends during the preStop delay. With a
follow time, a SIGTERM only arms a deadline: the worker keeps serving until the gateway says
its drain is over (``InstanceState.DRAINED``, set once no request is in flight), the instance
stops or disappears (its own loop notices that), or the deadline passes. A second SIGTERM (or
SIGINT) stops at once. Without a follow time a SIGTERM stops the worker after its current
batch, as before: the right thing for a supervisor that stops its workers last.
"""

from __future__ import annotations

import logging
import time

from shmgate.shared.vocabulary import InstanceState

__all__ = ["StopRequest"]

log = logging.getLogger("shmgate.worker")


class StopRequest:
    """Records SIGTERM/SIGINT and decides, each turn of the worker loop, whether to stop now."""

    def __init__(self, follow_drain_s: float) -> None:
        self.follow_drain_s = follow_drain_s
        self._asked_at: float | None = None
        self._now = False

    @property
    def asked(self) -> bool:
        """A stop was requested (the worker exits cleanly, whatever ends it)."""
        return self._asked_at is not None

    def signal(self) -> None:
        """The signal handler's whole job: note the request (a second one means now)."""
        if self._asked_at is not None or self.follow_drain_s <= 0:
            self._now = True
        if self._asked_at is None:
            self._asked_at = time.monotonic()

    def due(self, instance_state: int) -> bool:
        """True when the worker should stop taking work now."""
        if self._asked_at is None:
            return False
        if self._now:
            return True
        if instance_state == InstanceState.DRAINED:
            log.info("the gateway finished draining; stopping")
            return True
        if time.monotonic() - self._asked_at >= self.follow_drain_s:
            log.warning("still draining after %.0f s (--follow-drain-s); stopping", self.follow_drain_s)
            return True
        return False
