"""AsyncSender serves waiters first come, first served, on a real POSIX message queue.

When the request queue is full, a frontend's sends wait. They used to race for each free place
(every waiter woke and retried, and a new send could slip in before all of them), so an unlucky
request could wait far longer than later ones: part of the latency tail. Now they wait in order in
sender threads whose blocking sends the kernel queues in order with other processes' senders. These tests fill a small
queue, line up sends, and read the queue back one message at a time: the order must be the order
of the sends. No timing is asserted; the hang guards only bound a broken implementation.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from shmgate.shared import channels
from shmgate.shared.channels import AsyncSender, Queue
from shmgate.shared.errors import ChannelFull
from shmgate.shared.instance import Instance
from shmgate.shared.wire import Submit
from tests import shm_children
from tests.serving import wait_until
from tests.shm_children import scratch_instance

HANG_S = 30.0


@pytest.fixture()
def instance() -> Iterator[Instance]:
    with scratch_instance(arena_size=1 << 20, n_frontends=1, n_workers=1, queue_depth=2) as inst:
        yield inst


async def _receive_one(queue: Queue) -> int:
    """The next message's request id, yielding to the event loop until one is there."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG_S
    while loop.time() < deadline:
        message = queue.try_receive()
        if message is not None:
            assert isinstance(message, Submit)
            return message.request_id
        await asyncio.sleep(0.01)
    raise AssertionError("nothing arrived on the queue")


async def _receive_all(consumer: Queue, count: int, waiting: list[asyncio.Task[None]]) -> list[int]:
    """The next ``count`` request ids; then every waiting send must have gone, and nothing else be queued."""
    received = [await _receive_one(consumer) for _ in range(count)]
    await asyncio.wait_for(asyncio.gather(*waiting), HANG_S)
    assert consumer.try_receive() is None
    return received


def test_waiting_sends_go_in_their_order_and_new_ones_queue_behind(instance: Instance) -> None:
    async def scenario() -> list[int]:
        producer, consumer = instance.request_queue(), instance.request_queue()
        sender = AsyncSender(producer)
        try:
            await sender.send(Submit(1, 0, "m"), HANG_S)
            await sender.send(Submit(2, 0, "m"), HANG_S)  # the queue (depth 2) is full now
            waiting = []
            for request_id in (10, 11, 12, 13):
                waiting.append(asyncio.create_task(sender.send(Submit(request_id, 0, "m"), HANG_S)))
                await asyncio.sleep(0)  # each starts waiting before the next is sent
            received = [await _receive_one(consumer)]  # a free place: 10 must take it, not a newcomer
            waiting.append(asyncio.create_task(sender.send(Submit(14, 0, "m"), HANG_S)))
            while len(received) < 7:
                received.append(await _receive_one(consumer))
            await asyncio.wait_for(asyncio.gather(*waiting), HANG_S)
            return received
        finally:
            sender.close()
            producer.close()
            consumer.close()

    assert asyncio.run(scenario()) == [1, 2, 10, 11, 12, 13, 14]


def test_a_send_that_timed_out_never_goes_later(instance: Instance) -> None:
    async def scenario() -> list[int]:
        producer, consumer = instance.request_queue(), instance.request_queue()
        sender = AsyncSender(producer)
        try:
            await sender.send(Submit(1, 0, "m"), HANG_S)
            await sender.send(Submit(2, 0, "m"), HANG_S)
            with pytest.raises(ChannelFull):
                await sender.send(Submit(3, 0, "m"), 0.05)  # gave up: its request failed with 503
            late = asyncio.create_task(sender.send(Submit(4, 0, "m"), HANG_S))
            await asyncio.sleep(0)
            received = [await _receive_one(consumer) for _ in range(3)]
            await asyncio.wait_for(late, HANG_S)
            return received
        finally:
            sender.close()
            producer.close()
            consumer.close()

    assert asyncio.run(scenario()) == [1, 2, 4]


def test_close_ends_a_send_blocked_on_a_full_queue(instance: Instance) -> None:
    """A frontend that stops must not wait out its sends' timeouts (its process exits after the thread)."""

    async def scenario() -> None:
        producer = instance.request_queue()
        sender = AsyncSender(producer)
        try:
            await sender.send(Submit(1, 0, "m"), HANG_S)
            await sender.send(Submit(2, 0, "m"), HANG_S)
            blocked = asyncio.create_task(sender.send(Submit(3, 0, "m"), HANG_S))
            await asyncio.sleep(0.05)
            sender.close()
            with pytest.raises(ChannelFull):
                await asyncio.wait_for(blocked, HANG_S / 2)  # within a slice, far before its own timeout
        finally:
            producer.close()

    asyncio.run(scenario())


def test_two_senders_share_a_full_queue_in_the_order_their_sends_began(instance: Instance) -> None:
    """Across frontends: a frontend with many waiting sends is not held to one place per turn.

    Frontend A lines up six sends, then frontend B two: with one send per frontend in the kernel's
    line they took turns (10, 20, 11, 21, 12, ...); now every waiting send is in the line, so A's
    earlier ones go first.
    """

    async def scenario() -> list[int]:
        a_queue, b_queue, consumer = instance.request_queue(), instance.request_queue(), instance.request_queue()
        a, b = AsyncSender(a_queue), AsyncSender(b_queue)
        try:
            await a.send(Submit(1, 0, "m"), HANG_S)
            await a.send(Submit(2, 0, "m"), HANG_S)  # full (depth 2)
            waiting = []
            for request_id in (10, 11, 12, 13, 14, 15):
                waiting.append(asyncio.create_task(a.send(Submit(request_id, 0, "m"), HANG_S)))
                await asyncio.sleep(0.02)  # in the kernel's line before the next
            for request_id in (20, 21):
                waiting.append(asyncio.create_task(b.send(Submit(request_id, 0, "m"), HANG_S)))
                await asyncio.sleep(0.02)
            received = [await _receive_one(consumer) for _ in range(10)]
            await asyncio.wait_for(asyncio.gather(*waiting), HANG_S)
            return received
        finally:
            a.close()
            b.close()
            for q in (a_queue, b_queue, consumer):
                q.close()

    assert asyncio.run(scenario()) == [1, 2, 10, 11, 12, 13, 14, 15, 20, 21]


def test_a_cancelled_waiting_send_never_goes(instance: Instance) -> None:
    async def scenario() -> list[int]:
        producer, consumer = instance.request_queue(), instance.request_queue()
        sender = AsyncSender(producer, threads=1)  # the second waiting send waits for the thread, not the kernel
        try:
            await sender.send(Submit(1, 0, "m"), HANG_S)
            await sender.send(Submit(2, 0, "m"), HANG_S)
            first = asyncio.create_task(sender.send(Submit(3, 0, "m"), HANG_S))
            await asyncio.sleep(0.02)
            dropped = asyncio.create_task(sender.send(Submit(4, 0, "m"), HANG_S))
            await asyncio.sleep(0.02)
            dropped.cancel()
            last = asyncio.create_task(sender.send(Submit(5, 0, "m"), HANG_S))
            await asyncio.sleep(0.02)
            return await _receive_all(consumer, 4, [first, last])
        finally:
            sender.close()
            producer.close()
            consumer.close()

    assert asyncio.run(scenario()) == [1, 2, 3, 5]


def _sender_threads() -> int:
    return sum(t.name == "send" for t in threading.enumerate())


def test_idle_sender_threads_exit_and_a_later_burst_starts_new_ones(
    instance: Instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst leaves no threads behind once idle (bench/soak.py counts a frontend's threads at rest)."""
    monkeypatch.setattr(channels, "SENDER_IDLE_S", 0.05)

    async def burst(sender: AsyncSender, consumer: Queue, first: int) -> list[int]:
        await sender.send(Submit(first, 0, "m"), HANG_S)
        await sender.send(Submit(first + 1, 0, "m"), HANG_S)  # full
        waiting = []
        for request_id in range(first + 2, first + 6):
            waiting.append(asyncio.create_task(sender.send(Submit(request_id, 0, "m"), HANG_S)))
            await asyncio.sleep(0)
        await asyncio.sleep(0.02)
        assert _sender_threads() >= 1
        return await _receive_all(consumer, 6, waiting)

    def no_sender_threads() -> bool:
        return _sender_threads() == 0

    # an earlier test's closed sender: its threads end within a slice
    wait_until(no_sender_threads, HANG_S, "an earlier sender's threads ended")
    producer, consumer = instance.request_queue(), instance.request_queue()
    sender = AsyncSender(producer)
    try:
        first = asyncio.run(burst(sender, consumer, 10))
        wait_until(no_sender_threads, HANG_S, "the first burst's idle threads exited")
        after_first = _sender_threads()
        second = asyncio.run(burst(sender, consumer, 20))
        wait_until(no_sender_threads, HANG_S, "the second burst's idle threads exited")
        after_second = _sender_threads()
    finally:
        sender.close()
        producer.close()
        consumer.close()
    assert first == list(range(10, 16)) and second == list(range(20, 26))
    assert after_first == 0 and after_second == 0


def test_a_frontend_killed_with_sends_blocked_in_the_kernel_leaves_no_trace(instance: Instance) -> None:
    """kill -9 at the worst moment for the sender: another process's sends are blocked in ``mq_timedsend``.

    The dead frontend's waiting sends never enter the queue (the kernel drops a blocked sender with
    its process), the live frontend's sends, which lined up behind them, all go in their order, and
    the queue is empty afterwards: no torn or stray message.
    """
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe(duplex=False)
    victim = spawn.Process(
        target=shm_children.send_behind_a_full_queue, args=(instance.names.instance_id, 10, 5, theirs), daemon=True
    )

    async def scenario() -> list[int]:
        producer, consumer = instance.request_queue(), instance.request_queue()
        sender = AsyncSender(producer)
        try:
            await sender.send(Submit(1, 0, "m"), HANG_S)
            await sender.send(Submit(2, 0, "m"), HANG_S)  # full (depth 2)
            victim.start()
            theirs.close()
            assert await asyncio.to_thread(ours.poll, HANG_S), "the victim did not line up its sends"
            assert ours.recv() == 5  # all five still waiting
            ours_waiting = []
            for request_id in (20, 21, 22):
                ours_waiting.append(asyncio.create_task(sender.send(Submit(request_id, 0, "m"), HANG_S)))
                await asyncio.sleep(0.02)  # behind the victim's in the kernel's line
            os.kill(victim.pid, signal.SIGKILL)
            await asyncio.to_thread(victim.join, HANG_S)
            assert victim.exitcode == -signal.SIGKILL
            return await _receive_all(consumer, 5, ours_waiting)
        finally:
            sender.close()
            producer.close()
            consumer.close()
            if victim.pid is not None:  # started
                shm_children.stop_process(victim)

    assert asyncio.run(scenario()) == [1, 2, 20, 21, 22]


def test_a_thread_blocked_on_a_full_queue_is_seen_in_the_kernels_line(instance: Instance) -> None:
    """The order of a frontend's waiting sends rests on reading this from /proc (AsyncSender._wait_until_in_line)."""
    if not channels._wchan_is_visible():
        pytest.skip("this kernel or sandbox hides /proc/<pid>/task/<tid>/wchan")
    producer = instance.request_queue()
    producer.send(Submit(1, 0, "m"), HANG_S)
    producer.send(Submit(2, 0, "m"), HANG_S)  # full (depth 2)
    tids: list[int] = []
    outcome: list[BaseException | None] = []

    def blocked_send() -> None:
        tids.append(threading.get_native_id())
        try:
            producer.send(Submit(3, 0, "m"), 2.0)
            outcome.append(None)
        except ChannelFull as exc:
            outcome.append(exc)

    thread = threading.Thread(target=blocked_send)
    thread.start()
    try:
        deadline = time.monotonic() + HANG_S
        while not (tids and channels._in_a_queue_wait(channels._wchan(tids[0]))):
            assert time.monotonic() < deadline, (
                f"never seen blocked: wchan {channels._wchan(tids[0]) if tids else None!r}"
            )
            time.sleep(0.001)
        assert channels._wchan(tids[0]) not in (None, "0")  # seen asleep in the queue, not gone
    finally:
        thread.join(HANG_S)
        producer.close()
    assert outcome and isinstance(outcome[0], ChannelFull)  # nobody received: it timed out in the kernel
