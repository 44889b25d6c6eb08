"""worker/prefetch.py: the hand-off between the thread that prepares batches and the one that runs them.

Counts and orders only: the producer here is a function the test steers with events, so "the
consumer has not taken the last item yet" is a state the test holds, not a timing.
"""

from __future__ import annotations

import os
import select
import threading

import pytest

from worker.prefetch import Prefetcher

HANG_S = 30.0  # hang guard for every wait: never a pass/fail timing


class Steered:
    """A producer that hands out 1, 2, 3, ... and records how many it started."""

    def __init__(self, *, fail_at: int = 0) -> None:
        self.started = 0
        self.calls = threading.Semaphore(0)  # released once per produce() call
        self.fail_at = fail_at

    def __call__(self) -> int | None:
        self.started += 1
        self.calls.release()
        if self.started == self.fail_at:
            raise RuntimeError("the producer failed")
        return self.started


def _wait_for_calls(producer: Steered, n: int) -> None:
    for _ in range(n):
        assert producer.calls.acquire(timeout=HANG_S)


def test_items_come_in_order_and_one_at_most_is_prepared_ahead() -> None:
    producer = Steered()
    prefetcher = Prefetcher(producer).start()
    _wait_for_calls(producer, 1)
    assert not producer.calls.acquire(timeout=0.05)  # item 1 waits for the consumer: nothing more is produced
    assert producer.started == 1
    assert prefetcher.get(HANG_S) == 1  # taking it gives the credit back: item 2 is produced
    _wait_for_calls(producer, 1)
    assert prefetcher.get(HANG_S) == 2
    assert prefetcher.get(HANG_S) == 3
    left = prefetcher.drain(HANG_S)
    assert left in ([], [4])  # the item being produced when it stopped is handed over, not dropped
    assert producer.started == 3 + len(left)
    prefetcher.close()


def test_nothing_produced_means_get_returns_none_and_the_producer_is_asked_again() -> None:
    calls = threading.Semaphore(0)

    def produce() -> int | None:
        calls.release()
        return None

    prefetcher = Prefetcher(produce).start()
    for _ in range(3):  # each empty call gives the credit back at once
        assert calls.acquire(timeout=HANG_S)
    assert prefetcher.get(0.01) is None
    assert prefetcher.drain(HANG_S) == []
    prefetcher.close()


def test_a_producer_exception_is_raised_in_the_consumer() -> None:
    prefetcher = Prefetcher(Steered(fail_at=2)).start()
    assert prefetcher.get(HANG_S) == 1
    with pytest.raises(RuntimeError, match="the producer failed"):
        for _ in range(int(HANG_S / 0.05)):
            prefetcher.get(0.05)
    prefetcher.drain(HANG_S)
    prefetcher.close()


def test_the_consumer_starting_to_wait_is_written_to_the_wake_descriptor() -> None:
    gate = threading.Event()

    def produce() -> int | None:
        gate.wait(HANG_S)  # holds its "batch open" until the test says
        return 1

    prefetcher = Prefetcher(produce).start()
    assert prefetcher.consumer_busy  # nobody asked yet: a producer may keep gathering
    assert prefetcher.get(0.01) is None
    assert not prefetcher.consumer_busy
    readable, _, _ = select.select([prefetcher.wake_fd], [], [], HANG_S)
    assert readable == [prefetcher.wake_fd]
    assert os.read(prefetcher.wake_fd, 16) == b"w"  # once per start of a wait, not per get
    assert prefetcher.get(0.01) is None
    assert select.select([prefetcher.wake_fd], [], [], 0)[0] == []
    gate.set()
    assert prefetcher.get(HANG_S) == 1
    assert prefetcher.consumer_busy  # it took an item: it runs it now
    prefetcher.drain(HANG_S)
    prefetcher.close()


def test_drain_returns_a_prepared_item_nobody_took() -> None:
    producer = Steered()
    prefetcher = Prefetcher(producer).start()
    _wait_for_calls(producer, 1)
    assert prefetcher.drain(HANG_S) == [1]
    assert prefetcher.drain(HANG_S) == []  # taken once
    prefetcher.close()
