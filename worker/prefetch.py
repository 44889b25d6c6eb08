"""One batch ahead: a thread prepares the next batch while the current one runs.

Who uses this: worker/main.py. ``produce`` (collect a batch, validate it, start
its device copy, wait for the copy, release the arena) runs in a daemon thread;
the worker's main thread takes each result with ``get`` and runs the model on
it. The hand-off holds at most one prepared batch. While the consumer runs an
item, the thread starts collecting the next only after the consumer took the
previous one (a credit); while the consumer is idle it starts at once, since
the consumer takes the previous one at once. Either way a worker never holds
more than two batches (one running or about to, one prepared or being
collected): other workers can still take the rest from the shared request queue.
The hand-off is two plain locks, so each side waits in C, and a producer that
finds the consumer idle does not sleep until the consumer has woken up.

Rules this keeps:
- a produced batch is never dropped: after ``stop`` the thread finishes the
  ``produce`` call it is in and hands the result over; ``drain`` returns every
  result the consumer has not taken, for the worker to run or fail;
- an exception in ``produce`` is not swallowed: the thread stops and ``get``
  re-raises it in the consumer (the worker then dies like it did before the
  pipeline, and the frontends retry what it had claimed).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Prefetcher"]

T = TypeVar("T")

_CREDIT_POLL_S = 0.1  # how often a producer waiting for the consumer looks at the stop flag


class Prefetcher(Generic[T]):
    def __init__(
        self, produce: Callable[[], T | None], *, name: str = "prefetch", waiting: Callable[[], None] | None = None
    ) -> None:
        """``produce()`` returns the next item, or None when there was nothing to do (it is called again).
        ``waiting()``: called every ``_CREDIT_POLL_S`` while a prepared item waits for the consumer (the
        worker answers its requests' cancels there)."""
        self._produce = produce
        self._waiting_turn = waiting
        # Two plain locks, each waited on in C: one acquire or release per side and item, where a
        # queue.Queue, a Semaphore and an Event each run a Condition's Python code per call.
        self._item: T | None = None  # the prepared item, while ``_filled`` is released
        self._filled = threading.Lock()
        self._filled.acquire()  # released: ``_item`` holds an item for the consumer
        # Free: the consumer took the last item, so the slot may be filled again (the producer takes
        # it once per item it hands over; the consumer gives it back once per item it takes).
        self._taken = threading.Lock()
        self._stop = False
        self._waiting = False  # the consumer is in get(): it has nothing to run
        self._full = False  # the slot holds an item the consumer has not taken yet: it will run it next
        self._wake_r, self._wake_w = os.pipe()  # a byte each time the consumer starts waiting
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> Prefetcher[T]:
        self._thread.start()
        return self

    @property
    def wake_fd(self) -> int:
        """Readable when the consumer started waiting: a producer holding a batch open should cut it."""
        return self._wake_r

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):  # full (the producer drains it) or closed: nothing to tell
            pass

    @property
    def consumer_busy(self) -> bool:
        """True while the consumer works on an item it took, or has one waiting in the slot (the producer may
        keep gathering)."""
        return not self._waiting or self._full

    def get(self, timeout_s: float) -> T | None:
        """The next prepared item, or None after ``timeout_s``. Re-raises the producer's exception."""
        if not self._waiting:
            self._waiting = True
            self._wake()
        if not self._filled.acquire(timeout=timeout_s):
            if self._error is not None:
                raise self._error from None
            return None
        item, self._item = self._item, None
        self._full = self._waiting = False
        self._taken.release()  # the slot is free again (and a producer waiting for that may go on)
        return item

    def stop(self) -> None:
        """Ask the thread to stop after the item it is producing (which is still handed over)."""
        self._stop = True

    def drain(self, timeout_s: float) -> list[T]:
        """Stop, wait up to ``timeout_s`` for the thread, and return the items nobody took."""
        self.stop()
        self._waiting = True  # nobody is busy any more: a producer holding a batch open cuts it now
        self._wake()
        left: list[T] = []
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._take_left(left)  # a producer with a finished item may be waiting for the slot
            self._thread.join(0.01)
        self._take_left(left)
        return left

    def _take_left(self, left: list[T]) -> None:
        if self._filled.acquire(blocking=False):
            item, self._item = self._item, None
            assert item is not None
            left.append(item)
            self._full = False
            self._taken.release()

    def close(self) -> None:
        """Close the wake pipe; after ``drain`` (the thread no longer reads it)."""
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    def _loop(self) -> None:
        slot_ours = False  # ``_taken`` is ours: the slot is empty and this thread fills it next
        try:
            while not self._stop:
                if not slot_ours and not self._waiting:
                    # The consumer is running an item: collect the next only once it took the last
                    # one (the credit), or this worker would hold a third batch.
                    if not self._taken.acquire(timeout=_CREDIT_POLL_S):
                        if self._waiting_turn is not None:
                            self._waiting_turn()
                        continue
                    slot_ours = True
                    if self._stop:  # given back by drain: stopping, so nothing new is collected
                        break
                # Otherwise the consumer is idle and takes what is in the slot at once: collecting
                # now holds at most that item and this one, and spares this thread a sleep per item
                # (waiting for the credit while the consumer wakes up to take it).
                item = self._produce()
                if item is None:
                    continue
                while not slot_ours:  # collected beside an item the consumer had not taken yet
                    slot_ours = self._taken.acquire(timeout=_CREDIT_POLL_S)
                self._item = item
                self._full = True
                slot_ours = False
                self._filled.release()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which decides (worker/main.py: die)
            self._error = exc
