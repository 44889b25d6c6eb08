"""worker/prefetch.py: the hand-off between the thread that prepares batches and the one that runs them.

Counts and orders only: the producer here is a function the test steers with events, so "the
consumer has not taken the last item yet" is a state the test holds, not a timing.
"""

from __future__ import annotations

import os
import select
import threading
import time

import pytest

from shmgate.worker.prefetch import Prefetcher

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


def test_while_the_consumer_is_idle_the_next_item_is_collected_before_the_last_is_taken() -> None:
    """An idle consumer takes what is in the slot at once: the producer goes on without waiting for that
    (a sleep per item it would otherwise spend), and never holds more than that item and one more."""
    producer = Steered()
    prefetcher = Prefetcher(producer)
    assert prefetcher.get(0.01) is None  # the consumer waits: it is idle
    prefetcher.start()
    _wait_for_calls(producer, 2)  # item 1 sits in the slot, untaken, and item 2 is collected beside it
    assert not producer.calls.acquire(timeout=0.05)  # but no third: item 2 waits for the slot
    assert producer.started == 2
    assert prefetcher.consumer_busy  # item 1 is the consumer's next: a batch being collected now is held
    assert prefetcher.get(HANG_S) == 1  # the consumer runs item 1 now (busy): item 2 takes the slot
    _wait_for_calls(producer, 0)
    assert prefetcher.get(HANG_S) == 2
    prefetcher.drain(HANG_S)
    prefetcher.close()


def test_drain_takes_what_a_producer_finished_beside_an_untaken_item() -> None:
    producer = Steered()
    prefetcher = Prefetcher(producer)
    assert prefetcher.get(0.01) is None
    prefetcher.start()
    _wait_for_calls(producer, 2)
    assert prefetcher.drain(HANG_S) == [1, 2]  # the second was waiting for the slot: not dropped


def _producer_sleeps_per_item(items: int) -> float:
    """Voluntary context switches of the producer thread per item, handing to a consumer that is always
    waiting; each item costs the producer one sleep of its own (1 ms, as a message's arrival would)."""
    tids: list[int] = []

    def produce() -> int | None:
        if not tids:
            tids.append(threading.get_native_id())
        time.sleep(0.001)
        return 1

    def switches() -> int:
        with open(f"/proc/self/task/{tids[0]}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))

    prefetcher = Prefetcher(produce)
    assert prefetcher.get(0.01) is None
    prefetcher.start()
    for _ in range(5):
        assert prefetcher.get(HANG_S) == 1
    before = switches()
    for _ in range(items):
        assert prefetcher.get(HANG_S) == 1
    sleeps = switches() - before
    prefetcher.drain(HANG_S)
    prefetcher.close()
    return sleeps / items


def test_handing_to_an_idle_consumer_costs_the_producer_no_sleep_of_its_own() -> None:
    # 1 per item is the producer's own sleep; waiting for the credit after each hand-off made it 2
    assert _producer_sleeps_per_item(100) < 1.5
