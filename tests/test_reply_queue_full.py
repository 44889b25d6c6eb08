"""A worker does not wait again and again on a frontend that stopped reading its replies.

A frontend SIGKILLed with its supervisor reads nothing more but looks alive until its heartbeat ages;
each reply to it waited the full timeout, so a worker stopping after its supervisor's death outlived
it by over 10 s under load. A reply queue that stayed full for a whole wait is now tried without
waiting for a while (``PosixWorkerLink.send_reply``); once it has room again it is waited on again.
"""

from __future__ import annotations

from typing import Any

import pytest

from shmgate.shared.channels import Queue
from shmgate.shared.errors import ChannelFull
from shmgate.shared.instance import Instance
from shmgate.shared.transport.posix import PosixWorkerLink
from shmgate.shared.wire import Released


@pytest.fixture
def link():  # type: ignore[no-untyped-def]
    inst = Instance.create(arena_size=1 << 20, n_frontends=1, n_workers=1, queue_depth=1, model="checksum")
    worker = PosixWorkerLink(inst)
    worker.claim("checksum")
    try:
        yield inst, worker
    finally:
        worker.close()
        inst.unlink()
        inst.close()


def test_a_queue_that_stayed_full_is_not_waited_on_again(link, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    inst, worker = link
    waits: list[float] = []
    send = Queue.send

    def recorded(self: Queue, message: Any, timeout_s: float) -> None:
        waits.append(timeout_s)
        send(self, message, timeout_s)

    monkeypatch.setattr(Queue, "send", recorded)
    replies = inst.reply_queue(0)
    sent = 0
    while True:  # fill the frontend's reply queue: nobody reads it
        try:
            worker.send_reply(0, Released(sent), 0.05)
        except ChannelFull:
            break
        sent += 1
    assert sent == replies.depth and waits[-1] == 0.05, "the first full send waited its timeout"
    for _ in range(3):
        with pytest.raises(ChannelFull):
            worker.send_reply(0, Released(99), 2.0)
    assert waits[-3:] == [0.0, 0.0, 0.0], "a queue that stayed full was waited on again"
    assert replies.try_receive() is not None  # the frontend reads one: there is room
    worker.send_reply(0, Released(100), 2.0)
    assert waits[-1] == 0.0  # still tried without waiting, and it went through
    with pytest.raises(ChannelFull):
        worker.send_reply(0, Released(101), 0.05)
    assert waits[-1] == 0.05, "after a send went through, the queue is waited on again"
    replies.close()
