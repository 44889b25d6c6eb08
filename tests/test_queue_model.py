"""bench_client/queue_model.py: the ideal FCFS queue the open-loop figures are compared with.

The simulator is checked against what queueing theory says exactly, so its "ideal" is a real bound.
"""

from __future__ import annotations

import pytest

from shmgate.bench_client.queue_model import ideal_latencies, model_point, quantile


def test_md1_mean_wait_matches_pollaczek_khinchine() -> None:
    service, rho = 0.010, 0.8
    latencies = ideal_latencies(rho / service, 1, service, 0.0, count=100_000)
    mean_wait = sum(latencies) / len(latencies) - service
    assert mean_wait == pytest.approx(rho * service / (2 * (1 - rho)), rel=0.06)  # 20 ms


def test_a_lone_request_is_served_at_once_plus_the_floor() -> None:
    latencies = ideal_latencies(0.01, 2, 0.020, 0.005, count=2_000)  # one arrival per 100 s: nobody waits
    assert quantile(latencies, 0.99) == pytest.approx(0.025)


def test_the_point_scales_service_time_to_the_measured_capacity() -> None:
    point = model_point(80.0, 2, 100.0, 0.0)
    assert point["service_ms"] == 20.0 and point["load_pct"] == 80.0
    assert point["ideal_p50_ms"] >= 20.0 and point["ideal_p99_ms"] > point["ideal_p50_ms"]
