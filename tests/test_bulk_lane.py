"""The bulk lane on real POSIX message queues: a worker takes interactive descriptors before bulk ones.

Batch lines (gateway/batch_runner.py) are sent at the request queue's lower priority
(shared/transport/base.py ``BULK``); the kernel delivers the highest priority first, so an
interactive request never waits behind bulk ones already queued. The lane is chosen per request
by gateway/lane.py, from a loopback peer's ``x-shmgate-lane: bulk`` header only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from shmgate.gateway import lane
from shmgate.shared.channels import AsyncSender, Queue
from shmgate.shared.instance import Instance
from shmgate.shared.transport.base import BULK, INTERACTIVE
from shmgate.shared.wire import Submit
from tests.shm_children import scratch_instance


@pytest.fixture()
def instance() -> Iterator[Instance]:
    with scratch_instance(arena_size=1 << 20, n_frontends=1, n_workers=1, queue_depth=4) as inst:
        yield inst


def _drain(queue: Queue) -> list[int]:
    ids = []
    while (message := queue.try_receive()) is not None:
        assert isinstance(message, Submit)
        ids.append(message.request_id)
    return ids


def test_an_interactive_descriptor_overtakes_queued_bulk_ones(instance: Instance) -> None:
    producer, consumer = instance.request_queue(), instance.request_queue()
    try:
        assert producer.try_send(Submit(1, 0, "m"), BULK)
        assert producer.try_send(Submit(2, 0, "m"), BULK)
        assert producer.try_send(Submit(3, 0, "m"), INTERACTIVE)
        assert _drain(consumer) == [3, 1, 2]  # bulk ones keep their order among themselves
    finally:
        producer.close()
        consumer.close()


def test_the_async_sender_carries_the_lane(instance: Instance) -> None:
    async def scenario() -> list[int]:
        producer, consumer = instance.request_queue(), instance.request_queue()
        sender = AsyncSender(producer)
        try:
            await sender.send(Submit(1, 0, "m"), 5.0, BULK)
            await sender.send(Submit(2, 0, "m"), 5.0)  # a send without a lane: priority 0, the bulk one's
            await sender.send(Submit(3, 0, "m"), 5.0, INTERACTIVE)
            return _drain(consumer)
        finally:
            sender.close()
            producer.close()
            consumer.close()

    assert asyncio.run(scenario()) == [3, 1, 2]


def test_the_lane_header_is_honoured_from_loopback_only() -> None:
    seen: list[int] = []

    async def app(scope: object, receive: object, send: object) -> None:
        seen.append(lane.priority())

    async def call(client: tuple[str, int], value: bytes) -> None:
        scope = {"type": "http", "headers": [(b"x-shmgate-lane", value)], "client": client}
        await lane.BulkLane(app)(scope, None, None)  # type: ignore[arg-type]

    asyncio.run(call(("127.0.0.1", 5000), b"bulk"))
    asyncio.run(call(("::1", 5000), b"bulk"))
    asyncio.run(call(("10.1.2.3", 5000), b"bulk"))
    asyncio.run(call(("127.0.0.1", 5000), b"interactive"))
    assert seen == [BULK, BULK, INTERACTIVE, INTERACTIVE]
    assert lane.priority() == INTERACTIVE
