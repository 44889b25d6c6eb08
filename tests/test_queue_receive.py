"""shared/channels.py ``Queue.try_receive``: an empty queue is told without a timed receive.

Every drain of a reply queue (a frontend, per reply) and of a worker's control queue (per batch)
ends on an empty queue; a ``receive(0)`` there costs a timed receive whose time is up (~16 µs of
CPU here), where the queue's attributes say "empty" for ~0.3 µs. Counted calls, not timings.
"""

from __future__ import annotations

from typing import Any

from shmgate.shared.channels import Queue
from shmgate.shared.wire import Cancel, worker_decoder
from tests.shm_children import scratch_instance


class CountingMq:
    """A posix_ipc queue that counts its receives."""

    def __init__(self, mq: Any) -> None:
        self._mq = mq
        self.receives = 0

    def receive(self, timeout: float | None = None) -> tuple[bytes, int]:
        self.receives += 1
        return self._mq.receive(timeout)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mq, name)


def test_an_empty_queue_is_told_without_a_receive_and_a_message_still_comes() -> None:
    with scratch_instance(arena_size=1 << 20, n_frontends=1, n_workers=1, queue_depth=4) as inst:
        sender = inst.control_queue(0)
        receiver = inst.control_queue(0)
        counting = CountingMq(receiver._mq)
        queue = Queue(counting, worker_decoder)  # type: ignore[arg-type]
        try:
            assert queue.try_receive() is None
            assert counting.receives == 0
            sender.send(Cancel(request_id=7, reply_slot=0), 1.0)
            assert queue.try_receive() == Cancel(request_id=7, reply_slot=0)
            assert queue.try_receive() is None
            assert counting.receives == 1
        finally:
            sender.close()
            receiver.close()
