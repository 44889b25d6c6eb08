"""The bulk lane: batch lines (gateway/batch_runner.py) wait behind every interactive request.

A request's lane is on the request itself: the batch runner hands each line to the pipeline with
``RequestContext(bulk=True)`` (gateway/request_context.py), the edge every HTTP request as
interactive, and the pipeline hands it down to the frontend, which sends a bulk request's descriptor
at the request queue's lower priority (shared/transport/base.py ``BULK``; ``Submit.bulk``), so a
worker takes every waiting interactive descriptor of its model first, and decodes its images in the
bulk pool (gateway/images.py). Nothing a client sends over HTTP can put a request in the bulk lane.

This middleware keeps the node's interactive demand: every POST to a model endpoint (the table of
gateway/endpoints.py) counts in this frontend's stats word ``INTERACTIVE_IN_FLIGHT`` from its first
byte to its last, and the node's sum of those words (``NodeStats.interactive_in_flight``) is what the
bulk lane yields to: the batch runner keeps fewer lines in flight while it is above zero, and a
worker holds bulk-only batches back to ride with the next interactive one (docs/BATCH.md, "Fairness").
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from shmgate.gateway.metrics import FrontendStats
from shmgate.shared.stats_layout import Counter

__all__ = ["BulkLane"]


class BulkLane:
    """Pure ASGI middleware: every POST to a model endpoint (``paths``: gateway/endpoints.py ``MODEL_PATHS``)
    counts as interactive demand while it is served.

    ``stats`` returns the frontend's counters, or None before the lifespan attached them.
    """

    def __init__(
        self, app: ASGIApp, paths: frozenset[str], stats: Callable[[], FrontendStats | None] = lambda: None
    ) -> None:
        self.app = app
        self.paths = paths
        self.stats = stats
        self.interactive = 0  # this frontend's interactive model requests in hand (published in the stats row)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST" and scope.get("path") in self.paths:
            await self._interactive(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _interactive(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._publish(+1)
        try:
            await self.app(scope, receive, send)
        finally:
            self._publish(-1)

    def _publish(self, change: int) -> None:
        self.interactive += change
        stats = self.stats()
        if stats is not None:  # set, not added: the row's words are unsigned, and a restart starts from 0
            stats.set(Counter.INTERACTIVE_IN_FLIGHT, self.interactive)
