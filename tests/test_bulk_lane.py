"""The bulk lane on real POSIX message queues: a worker takes interactive descriptors before bulk ones.

Batch lines (gateway/batch_runner.py) are sent at the request queue's lower priority
(shared/transport/base.py ``BULK``); the kernel delivers the highest priority first, so an
interactive request never waits behind bulk ones already queued. The lane is chosen per request
on the request itself (gateway/request_context.py): only the batch runner's lines, run in process, are
bulk; nothing sent over HTTP is.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from shmgate.gateway import lane
from shmgate.gateway.endpoints import MODEL_PATHS
from shmgate.gateway.frontend import Frontend, FrontendLimits
from shmgate.gateway.intake import IntakeLimits, parse_chat_request
from shmgate.gateway.metrics import FrontendStats
from shmgate.gateway.preprocess.vision import ChecksumPreprocessor
from shmgate.gateway.request_context import RequestContext
from shmgate.shared.channels import AsyncSender, Queue, YieldingSender
from shmgate.shared.instance import Instance
from shmgate.shared.stats_layout import STATS_WORDS, Counter
from shmgate.shared.transport.base import BULK, INTERACTIVE
from shmgate.shared.transport.memory import MemoryFrontendLink, MemoryNode
from shmgate.shared.wire import Submit
from shmgate.worker.batcher import Batcher
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


def test_the_lane_is_the_requests_own_and_a_bulk_one_is_sent_at_the_lower_priority() -> None:
    """No ambient lane: the frontend sends what the request's context says, whatever task sends it."""
    png = io.BytesIO()
    Image.new("RGB", (32, 24), (20, 140, 90)).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": url}}]
    body = json.dumps({"model": "checksum", "messages": [{"role": "user", "content": content}]}).encode()

    async def main() -> list[tuple[bool, int]]:
        node = MemoryNode()
        node.add_worker("checksum")
        link = MemoryFrontendLink(node, slot=0)
        sent: list[tuple[bool, int]] = []
        send = link.send_request

        async def recorded(submit: Submit, timeout_s: float, priority: int = INTERACTIVE) -> None:
            sent.append((submit.bulk, priority))
            await send(submit, timeout_s, priority)

        link.send_request = recorded  # type: ignore[method-assign]
        frontend = Frontend(link, ChecksumPreprocessor(), FrontendLimits())
        await frontend.start()
        try:
            for context in (RequestContext(), RequestContext(bulk=True), RequestContext()):
                frontend.abandon(await frontend.submit(parse_chat_request(body, IntakeLimits()), context=context))
        finally:
            await frontend.stop()
        return sent

    assert asyncio.run(main()) == [(False, INTERACTIVE), (True, BULK), (False, INTERACTIVE)]


def test_a_bulk_send_never_takes_the_place_an_interactive_send_waits_for(instance: Instance) -> None:
    """A full queue: the bulk send (which began first) yields the freed place to the interactive one."""

    async def scenario() -> tuple[list[int], list[int]]:
        producer, consumer = instance.request_queue(), instance.request_queue()
        interactive, bulk = AsyncSender(producer), YieldingSender(producer)
        try:
            for i in range(producer.depth):
                assert producer.try_send(Submit(10 + i, 0, "m"), BULK)
            late_bulk = asyncio.create_task(bulk.send(Submit(1, 0, "m"), 5.0, BULK))
            await asyncio.sleep(0.02)
            waiting = asyncio.create_task(interactive.send(Submit(2, 0, "m"), 5.0, INTERACTIVE))
            await asyncio.sleep(0.05)  # its sender thread is blocked in the kernel now
            assert consumer.try_receive() is not None  # frees one place
            await waiting
            first = _drain(consumer)
            await late_bulk
            return first, _drain(consumer)
        finally:
            interactive.close()
            bulk.close()
            producer.close()
            consumer.close()

    first, then = asyncio.run(scenario())
    assert first[0] == 2
    assert 1 not in first or first.index(1) > 0
    assert 1 in first + then


def test_interactive_model_requests_count_as_demand_while_they_are_served() -> None:
    row = np.zeros(STATS_WORDS, dtype="<u8")
    stats = FrontendStats(row)
    seen: list[int] = []

    async def app(scope: object, receive: object, send: object) -> None:
        seen.append(int(row[Counter.INTERACTIVE_IN_FLIGHT]))

    async def call(path: str, headers: list[tuple[bytes, bytes]], method: str = "POST") -> None:
        scope = {"type": "http", "method": method, "path": path, "headers": headers, "client": ("127.0.0.1", 1)}
        await lane.BulkLane(app, MODEL_PATHS, stats=lambda: stats)(scope, None, None)  # type: ignore[arg-type]

    asyncio.run(call("/v1/chat/completions", []))
    asyncio.run(call("/v1/embeddings", []))
    asyncio.run(call("/v1/chat/completions", [(b"x-shmgate-lane", b"bulk")]))  # no header makes it a batch line
    asyncio.run(call("/v1/batches", []))  # not a model request
    asyncio.run(call("/v1/models", [], method="GET"))
    assert seen == [1, 1, 1, 0, 0]
    assert int(row[Counter.INTERACTIVE_IN_FLIGHT]) == 0  # each ended


def _batcher(queue: Queue) -> Batcher[int]:
    r, w = os.pipe()
    os.set_blocking(r, False)

    def take(submit: Submit) -> int:
        return submit.request_id

    return Batcher(
        queue,
        max_batch_size=8,
        max_batch_wait_s=0.0,
        on_take=take,
        on_invalid=lambda _: None,
        more_coming=lambda: False,
        wake_fd=r,
    )


def test_a_worker_holds_batch_lines_back_for_an_interactive_request_to_ride_with(instance: Instance) -> None:
    producer, consumer = instance.request_queue(), instance.request_queue()
    try:
        batcher = _batcher(consumer)
        # No interactive demand: a batch line runs at once, alone.
        assert producer.try_send(Submit(1, 0, "m", bulk=True), BULK)
        assert batcher.collect(1.0, yield_bulk=lambda: False) == [1]
        # Demand: the line waits for the interactive request sent 20 ms later, and runs beside it.
        assert producer.try_send(Submit(2, 0, "m", bulk=True), BULK)
        timer = threading.Timer(0.02, lambda: producer.try_send(Submit(3, 0, "m"), INTERACTIVE))
        timer.start()
        assert batcher.collect(1.0, yield_bulk=lambda: True) == [2, 3]
        timer.join()
        # Demand that never reaches this worker: the line runs after BULK_HOLD_S at most.
        assert producer.try_send(Submit(4, 0, "m", bulk=True), BULK)
        assert batcher.collect(1.0, yield_bulk=lambda: True) == [4]
        # A batch with an interactive request is never held (here the window is 0: it runs alone).
        assert producer.try_send(Submit(5, 0, "m", bulk=True), BULK)
        assert producer.try_send(Submit(6, 0, "m"), INTERACTIVE)
        assert batcher.collect(1.0, yield_bulk=lambda: True) == [6]
        assert batcher.collect(1.0, yield_bulk=lambda: False) == [5]
    finally:
        producer.close()
        consumer.close()
