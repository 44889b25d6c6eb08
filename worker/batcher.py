"""Dynamic batching: wait for the first request, then a bounded window, cut at the maximum size.

The worker pulls from the shared request queue only what it is about to run
(and, with its pipeline, the one batch it prepares meanwhile), so an idle
worker, not a busy one, takes most requests: load balancing across workers
comes from the queue itself. Each descriptor taken is handed to ``on_take`` at
once, before the batch window ends: the worker claims it there (if this worker
dies from here on, the frontend knows whom to blame and retries elsewhere) and
starts its device copy.

What a worker takes while its model is busy is the batch policy
(``--batch-policy``, shared/flags.py):

- ``fcfs``: nothing. The next batch is collected only once the model is free, so
  every request waits in the one shared queue until the first worker that can run
  it *now* takes it: first come, first served across frontends and workers. It
  keeps a request from waiting behind a busy worker's batch while another worker
  is free, at the cost of a gap between batches; measured, it did not pay on a
  quiet machine, so it is opt-in (docs/benchmarks-history.md, "first come, first
  served across frontends").
- ``held`` (the default): a batch prepared while the model is still busy
  stays open after its window (``hold_open``), so it gathers what arrives
  until the model is free, as the batch of an unpipelined worker did; each
  item's copy has started on arrival. Copies overlap the running batch, but
  the held requests are this worker's, however long its batch runs.

Batch lines (``Submit.bulk``, the bulk lane) ride with interactive requests: the kernel hands a
worker every waiting interactive descriptor before a bulk one, and a batch of bulk lines only is
held back while the node has interactive requests in hand (``yield_bulk``), for at most
``BULK_HOLD_S``: it runs beside the next interactive request that arrives, or when that demand
ends. So a worker is never busy with batch lines alone when an interactive request comes (for a
backend that runs a batch as a whole; worker/main.py passes ``yield_bulk`` for those only).

The window is only waited for what is known to be coming: while the model is
idle, a batch is cut as soon as the request queue is empty and no frontend is
still decoding a request (``more_coming``). A lone request (concurrency 1, a
quiet service) then runs at once instead of paying the whole window; under load
the queue or the frontends' decode pools are rarely empty, and the window
batches as before. A held batch's waits also watch ``wake_fd``: the model
becoming free is written there, so a held batch is cut at that moment rather
than at the next poll. Every other wait is a blocking receive on the queue,
which the kernel hands to one waiting worker: a select on the queue's
descriptor would wake every waiting worker for each message.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from shmgate.shared.transport.base import MessageQueue
from shmgate.shared.wire import Submit

__all__ = ["Batcher"]

T = TypeVar("T")

WAKE_SLICE_S = 0.1  # while held open: the wake-up says when the model is free; this only bounds a missed one
# A batch of bulk lines only waits this long at most for an interactive request to ride with, looking at the
# node's interactive demand every BULK_POLL_S (it may end sooner: the lines then run at once).
BULK_HOLD_S = 0.05
BULK_POLL_S = 0.002


def _never() -> bool:
    return False


def _nothing() -> None:
    pass


class Batcher(Generic[T]):
    def __init__(
        self,
        queue: MessageQueue,
        *,
        max_batch_size: int,
        max_batch_wait_s: float,
        on_take: Callable[[Submit], T | None],
        on_invalid: Callable[[object], None],
        more_coming: Callable[[], bool],
        wake_fd: int,
        policy: str = "held",
    ) -> None:
        """``on_take(submit)`` claims a request and returns what the batch keeps, or None to drop it.

        ``more_coming()``: are requests on their way that the queue does not show yet (a constant
        True makes every batch wait its whole window). ``wake_fd``: a non-blocking descriptor that
        becomes readable when ``hold_open()`` may have turned false; the batcher drains it.
        """
        self._queue = queue
        self._more_coming = more_coming
        self._wake_fd = wake_fd
        self._max_batch_size = max(1, max_batch_size)
        self._max_batch_wait_s = max(0.0, max_batch_wait_s)
        self._on_take = on_take
        self._on_invalid = on_invalid
        if policy not in ("fcfs", "held"):
            raise ValueError(f"unknown batch policy {policy!r} (fcfs, held)")
        self._policy = policy
        self._took_bulk = False  # the last message ``_take`` kept was a batch line

    def collect(
        self,
        idle_timeout_s: float = 0.5,
        *,
        hold_open: Callable[[], bool] = _never,
        limit: int | None = None,
        yield_bulk: Callable[[], bool] = _never,
        on_held: Callable[[], None] = _nothing,
    ) -> list[T]:
        """The next batch; empty when nothing arrived within ``idle_timeout_s``.

        ``hold_open()`` says the model is busy: the batch keeps gathering (past its window, too),
        since running sooner is impossible anyway. While it is false, the batch is cut when the
        window ends or when nothing more is on its way. ``limit``: at most this many (at least one),
        below the maximum size: what a generation engine has room for, so a worker takes no more
        off the shared queue than it can start. ``yield_bulk()``: interactive requests are in hand on
        the node, so a batch of batch lines only waits for one of them (``_hold_bulk``). ``on_held()``:
        called at each turn of a held batch's wait (at least every ``WAKE_SLICE_S``), where the worker
        answers the cancels of what the batch holds (an item it answered is left in the batch).
        """
        batch: list[T] = []
        size = self._max_batch_size if limit is None else max(1, min(limit, self._max_batch_size))
        if self._policy == "fcfs":
            if not self._wait_until_free(idle_timeout_s, hold_open):
                return batch  # still busy: the caller looks at its stop flag and asks again
            hold_open = _never
        first = self._take(idle_timeout_s)
        if first is None:
            return batch
        bulk = 0  # batch lines in ``batch``
        if first is not False:
            batch.append(first)  # type: ignore[arg-type]
            bulk += self._took_bulk
        deadline = time.monotonic() + self._max_batch_wait_s
        while len(batch) < size:
            holding = hold_open()
            if batch and not holding and not self._waiting_helps():
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if self._policy == "fcfs" and batch and self._queue.current_messages() > 0:
                    remaining = 0.0  # fcfs: what is queued already costs no wait; it is next in line
                elif not batch or not holding:
                    break
                else:
                    remaining = WAKE_SLICE_S
            # Only a held batch needs the wake-up (it says the model is free, so cut now). Otherwise a
            # blocking receive waits: the kernel hands a message to one waiting receiver, where a
            # select on the queue's descriptor wakes every waiting worker for it and all but one
            # find it gone (measured: most of an idle-ish worker's CPU per request).
            item = self._take(remaining, wakeable=holding)
            if holding:
                on_held()
            if item is not None and item is not False:
                batch.append(item)  # type: ignore[arg-type]
                bulk += self._took_bulk
        if batch and bulk == len(batch) < size and yield_bulk():
            self._hold_bulk(batch, size, yield_bulk)
        return batch

    def _hold_bulk(self, batch: list[T], size: int, yield_bulk: Callable[[], bool]) -> None:
        """Keep a batch of batch lines open until an interactive request joins it (it then runs at
        once, the lines beside it), the node's interactive demand ends, or ``BULK_HOLD_S`` passed."""
        deadline = time.monotonic() + BULK_HOLD_S
        while len(batch) < size and (remaining := deadline - time.monotonic()) > 0:
            item = self._take(min(remaining, BULK_POLL_S))
            if item is None:
                if not yield_bulk():
                    return
                continue
            if item is False:
                continue
            batch.append(item)  # type: ignore[arg-type]
            if not self._took_bulk:
                return

    def _wait_until_free(self, timeout_s: float, busy: Callable[[], bool]) -> bool:
        """fcfs: wait (on ``wake_fd``) until ``busy()`` is false; False when ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while busy():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            readable, _, _ = select.select([self._wake_fd], [], [], min(remaining, WAKE_SLICE_S))
            if readable:
                try:
                    os.read(self._wake_fd, 4096)
                except BlockingIOError:
                    pass
        return True

    def _waiting_helps(self) -> bool:
        """Is a request on its way: queued already, or admitted by a frontend and still decoding?"""
        return self._queue.current_messages() > 0 or self._more_coming()

    def _take(self, timeout_s: float, *, wakeable: bool = False) -> T | None | bool:
        """A kept item, None on timeout (or a wake-up), False for a message taken and dropped."""
        try:
            if wakeable:
                message = self._receive_or_wake(timeout_s)
            else:
                message = self._queue.receive(timeout_s)
        except Exception as exc:  # malformed bytes on the queue: report and carry on
            self._on_invalid(exc)
            return False
        if message is None:
            return None
        if not isinstance(message, Submit):
            self._on_invalid(message)
            return False
        self._took_bulk = message.bulk
        kept = self._on_take(message)
        return False if kept is None else kept

    def _receive_or_wake(self, timeout_s: float) -> object | None:
        """Wait for a message or the wake descriptor; None on timeout, a wake-up, or a lost race.

        A POSIX message queue descriptor is pollable on Linux, so one select covers both.
        """
        readable, _, _ = select.select([self._queue.fd, self._wake_fd], [], [], max(0.0, timeout_s))
        if self._wake_fd in readable:
            try:
                os.read(self._wake_fd, 4096)
            except BlockingIOError:
                pass
        if self._queue.fd in readable:
            return self._queue.try_receive()  # None when another worker took it first
        return None
