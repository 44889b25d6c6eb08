"""Dynamic batching: wait for the first request, then a bounded window, cut at the maximum size.

The worker pulls from the shared request queue only what it is about to run,
so an idle worker, not a busy one, takes the next request: load balancing
across workers comes from the queue itself. Each descriptor taken is claimed
at once (``on_take``), before the batch window: if this worker dies from here
on, the frontend knows whom to blame and retries elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shared.channels import Queue
from shared.wire import Submit

__all__ = ["Batcher"]


class Batcher:
    def __init__(
        self,
        queue: Queue,
        *,
        max_batch_size: int,
        max_batch_wait_s: float,
        on_take: Callable[[Submit], bool],
        on_invalid: Callable[[object], None],
    ) -> None:
        """``on_take(submit)`` claims a request and says whether to keep it in the batch."""
        self._queue = queue
        self._max_batch_size = max(1, max_batch_size)
        self._max_batch_wait_s = max(0.0, max_batch_wait_s)
        self._on_take = on_take
        self._on_invalid = on_invalid

    def collect(self, idle_timeout_s: float = 0.5) -> list[Submit]:
        """The next batch; empty when nothing arrived within ``idle_timeout_s``."""
        batch: list[Submit] = []
        first = self._take(idle_timeout_s)
        if first is None:
            return batch
        if first is not False:
            batch.append(first)
        deadline = time.monotonic() + self._max_batch_wait_s
        while len(batch) < self._max_batch_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            item = self._take(remaining)
            if item is None:
                break
            if item is not False:
                batch.append(item)
        return batch

    def _take(self, timeout_s: float) -> Submit | None | bool:
        """A kept Submit, None on timeout, False for a message that was taken and dropped."""
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
        return message if self._on_take(message) else False
