"""worker/drain.py: when a worker that got SIGTERM stops taking work (the end-to-end check, with real
processes and simultaneous SIGTERM, is tests/test_pod_in_a_box.py)."""

from __future__ import annotations

import time

from shmgate.shared.segment import InstanceState
from shmgate.worker.drain import StopRequest


def test_without_a_follow_time_a_sigterm_stops_at_once() -> None:
    stop = StopRequest(0)
    assert not stop.due(InstanceState.RUNNING) and not stop.asked
    stop.signal()
    assert stop.asked and stop.due(InstanceState.RUNNING)


def test_following_the_drain_keeps_serving_until_the_gateway_is_drained() -> None:
    stop = StopRequest(60)
    stop.signal()
    assert stop.asked
    assert not stop.due(InstanceState.RUNNING)  # the gateway's preStop: it still takes requests
    assert not stop.due(InstanceState.DRAINING)  # requests in flight may still need a worker
    assert stop.due(InstanceState.DRAINED)


def test_following_ends_at_the_deadline() -> None:
    stop = StopRequest(0.05)
    stop.signal()
    assert not stop.due(InstanceState.DRAINING)
    time.sleep(0.06)
    assert stop.due(InstanceState.DRAINING)


def test_a_second_signal_stops_at_once() -> None:
    stop = StopRequest(60)
    stop.signal()
    stop.signal()
    assert stop.due(InstanceState.RUNNING)


def test_drained_means_nothing_without_a_signal() -> None:
    assert not StopRequest(60).due(InstanceState.DRAINED)


def test_the_sigterm_handler_takes_no_lock_and_the_loop_stops_on_it() -> None:
    """A signal handler runs on the main thread between two bytecodes, maybe while that thread holds the
    stop event's lock (or inside the handler itself, on a second SIGTERM): a handler that waited for a lock
    would wait forever. Here another thread holds the lock while the handler runs."""
    import threading

    from shmgate.shared.transport.memory import MemoryNode, MemoryWorkerLink
    from shmgate.worker.main import Worker, WorkerOptions

    worker = Worker(MemoryWorkerLink(MemoryNode()), WorkerOptions(model="checksum"))
    loop = threading.Thread(target=worker.run, daemon=True)
    loop.start()
    with worker._stop._cond:  # what the interrupted main thread may be holding
        handler = threading.Thread(target=worker.request_stop, daemon=True)
        handler.start()
        handler.join(5)
        assert not handler.is_alive()
    loop.join(10)
    assert not loop.is_alive() and worker.exit_code == 0
