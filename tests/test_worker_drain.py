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
