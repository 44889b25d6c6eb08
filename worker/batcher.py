"""Dynamic batching: wait for the first request, then a bounded window, cut at the maximum size.

The worker pulls from the shared request queue only what it is about to run
(and, with its pipeline, the one batch it prepares meanwhile), so an idle
worker, not a busy one, takes most requests: load balancing across workers
comes from the queue itself. Each descriptor taken is handed to ``on_take`` at
once, before the batch window ends: the worker claims it there (if this worker
dies from here on, the frontend knows whom to blame and retries elsewhere) and
starts its device copy.

A batch prepared while the model is still busy stays open after its window
(``hold_open``), so it gathers what arrives until the model is free, as the
batch of an unpipelined worker did; each item's copy has started on arrival.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

from shared.channels import Queue
from shared.wire import Submit

__all__ = ["Batcher"]

T = TypeVar("T")

HOLD_SLICE_S = 0.005  # while held open: how often to ask whether the model is free yet


def _never() -> bool:
    return False


class Batcher(Generic[T]):
    def __init__(
        self,
        queue: Queue,
        *,
        max_batch_size: int,
        max_batch_wait_s: float,
        on_take: Callable[[Submit], T | None],
        on_invalid: Callable[[object], None],
    ) -> None:
        """``on_take(submit)`` claims a request and returns what the batch keeps, or None to drop it."""
        self._queue = queue
        self._max_batch_size = max(1, max_batch_size)
        self._max_batch_wait_s = max(0.0, max_batch_wait_s)
        self._on_take = on_take
        self._on_invalid = on_invalid

    def collect(self, idle_timeout_s: float = 0.5, *, hold_open: Callable[[], bool] = _never) -> list[T]:
        """The next batch; empty when nothing arrived within ``idle_timeout_s``.

        After the batch window a non-empty batch stays open while ``hold_open()`` is true.
        """
        batch: list[T] = []
        first = self._take(idle_timeout_s)
        if first is None:
            return batch
        if first is not False:
            batch.append(first)  # type: ignore[arg-type]
        deadline = time.monotonic() + self._max_batch_wait_s
        while len(batch) < self._max_batch_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if not batch or not hold_open():
                    break
                remaining = HOLD_SLICE_S
            item = self._take(remaining)
            if item is not None and item is not False:
                batch.append(item)  # type: ignore[arg-type]
        return batch

    def _take(self, timeout_s: float) -> T | None | bool:
        """A kept item, None on timeout, False for a message that was taken and dropped."""
        try:
            message = self._queue.receive(timeout_s)
        except Exception as exc:  # malformed bytes on the queue: report and carry on
            self._on_invalid(exc)
            return False
        if message is None:
            return None
        if not isinstance(message, Submit):
            self._on_invalid(message)
            return False
        kept = self._on_take(message)
        return False if kept is None else kept
