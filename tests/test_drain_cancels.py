"""The worker's cancel reader never spins: a control queue that fails to read ends the pass."""

from __future__ import annotations

import threading

import msgspec

from shmgate.shared.wire import Cancel
from shmgate.worker.main import Worker


class _FailingControl:
    """A control queue that yields one malformed message, one cancel, then fails on every read."""

    def __init__(self) -> None:
        self.reads = 0

    def try_receive_control(self) -> object:
        self.reads += 1
        if self.reads == 1:
            raise msgspec.DecodeError("malformed")
        if self.reads == 2:
            return Cancel(request_id=7, reply_slot=1)
        raise OSError("the queue is gone")


def _worker_reading(link: _FailingControl) -> Worker:
    worker = object.__new__(Worker)  # only the cancel reader's state: no segment, no model
    worker.link = link  # type: ignore[assignment]
    worker._cancel_lock = threading.Lock()
    worker._cancelled = set()
    worker._jobs = {}
    worker._held = {}  # requests waiting in a held batch (none here)
    return worker


def test_a_failing_control_queue_ends_the_pass_instead_of_spinning() -> None:
    link = _FailingControl()
    worker = _worker_reading(link)
    done = threading.Thread(target=worker._drain_cancels, daemon=True)
    done.start()
    done.join(5)
    assert not done.is_alive(), "the cancel reader spun on a failing queue"
    assert link.reads == 3  # past the malformed message, the cancel read, then one failed read
    assert (1, 7) in worker._cancelled
