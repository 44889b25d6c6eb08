"""Pods in a box for tests (the machinery is bench_client/pods.py, shared with the scale-out benchmark)."""

from __future__ import annotations

import pytest

from shmgate.bench_client.pods import (  # noqa: F401  (re-exported for the tests)
    Container,
    Pod,
    gateway_argv,
    pods_unavailable,
    terminate_together,
    uid_prefix,
    worker_argv,
)


def require_pods() -> None:
    """Skip (with the reason) where pods cannot be built: not root, or no util-linux tools."""
    reason = pods_unavailable()
    if reason:
        pytest.skip(reason)
