"""A Cancel lost to a full control queue is sent again: a burst of hang-ups cancels every request.

On the in-memory transport (as tests/test_reply_routing.py): a worker's control queue holds 8 messages,
as the POSIX one does, and sending to it is best effort.
"""

from __future__ import annotations

import asyncio

from shmgate.gateway.frontend import Frontend
from shmgate.gateway.replies import CANCEL_RESEND_S
from shmgate.shared.errors import Cancelled
from shmgate.shared.transport.memory import MemoryFrontendLink, MemoryNode
from shmgate.shared.wire import Cancel, Claimed, failed_reply
from tests.test_reply_routing import _settle, _submit, _take, run


def _read_control(node: MemoryNode) -> set[int]:
    seen: set[int] = set()
    while (message := node.control[0].try_receive()) is not None:
        assert isinstance(message, Cancel)
        seen.add(message.request_id)
    return seen


def test_cancels_that_overflowed_the_control_queue_are_sent_again_until_the_worker_ends_them() -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        states = [await _submit(frontend) for _ in range(12)]
        submits = [_take(node) for _ in states]
        for submit in submits:
            node.reply(Claimed(submit.request_id, 0, 1))
        await _settle()
        for state in states:
            frontend.abandon(state)  # twelve clients hang up at once
        first = _read_control(node)
        assert len(first) == 8, "the queue holds 8: four cancels were lost"
        for request_id in first:  # the worker ends what it was told to cancel
            node.reply(failed_reply(request_id, 0, Cancelled("the client cancelled the request")))
        await _settle()
        assert sum(s.done for s in states) == 8
        await asyncio.sleep(CANCEL_RESEND_S + 0.3)  # the watchdog's passes
        again = _read_control(node)
        assert again == {s.request_id for s in submits} - first
        for request_id in again:
            node.reply(failed_reply(request_id, 0, Cancelled("the client cancelled the request")))
        await _settle()
        assert all(s.done for s in states) and link.cache.held_bytes == 0

    run(scenario)
