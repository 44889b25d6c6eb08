"""The bulk lane: batch lines (gateway/batch_runner.py) wait behind every interactive request.

The batch runner sends each line to its own node over loopback with ``x-shmgate-lane: bulk``; this
middleware notes it in a context variable, and the frontend sends that request's descriptor at the
request queue's lower priority (shared/transport/base.py ``BULK``), so a worker takes every waiting
interactive descriptor of its model first. The header is honoured only from a loopback peer: a
remote client can neither demote nor otherwise mark requests (behind a reverse proxy on the same
host, a client can at most demote its own requests).
"""

from __future__ import annotations

import ipaddress
from contextvars import ContextVar

from starlette.types import ASGIApp, Receive, Scope, Send

from shmgate.shared.transport.base import BULK, INTERACTIVE

__all__ = ["LANE_HEADER", "BulkLane", "priority"]

LANE_HEADER = "x-shmgate-lane"
_HEADER = LANE_HEADER.encode()

_bulk: ContextVar[bool] = ContextVar("shmgate_bulk_lane", default=False)


def priority() -> int:
    """The request queue priority of the request being served (its task's context)."""
    return BULK if _bulk.get() else INTERACTIVE


def _loopback(client: tuple[str, int] | None) -> bool:
    if client is None:
        return False
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


class BulkLane:
    """Pure ASGI middleware: a loopback request with ``x-shmgate-lane: bulk`` is served in the bulk lane."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == _HEADER:
                    if value.strip().lower() == b"bulk" and _loopback(scope.get("client")):
                        token = _bulk.set(True)
                        try:
                            await self.app(scope, receive, send)
                        finally:
                            _bulk.reset(token)
                        return
                    break
        await self.app(scope, receive, send)
