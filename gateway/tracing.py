"""The frontend's tracing switch: ``start_tracing`` makes this process's span hooks, which the request
path is handed (gateway/served.py ``Served.spans``, then each request's ``RequestContext.spans``).

Who calls it: gateway/process.py, once, with ``--otlp-traces-endpoint``, before the app is built; the
app is then wrapped in the server-span middleware (``traced_app``). Off, nothing is made: a hook is
``if spans is not None: spans.<stage>(...)`` on the request's own field, that test is the whole cost,
and neither this module nor any hook imports OpenTelemetry (gateway/request_spans.py, which does, is
imported here only when tracing is turned on).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp

if TYPE_CHECKING:
    from shmgate.gateway.request_spans import RequestSpans

__all__ = ["start_tracing", "traced_app"]

ACCESS_LOGGER = "uvicorn.access"


def start_tracing(endpoint: str, *, slot: int) -> RequestSpans:
    """Start exporting to ``endpoint``: this frontend's span hooks."""
    from shmgate.gateway.request_spans import RequestSpans
    from shmgate.shared.tracing import start_provider

    provider = start_provider(endpoint, "frontend", {"shmgate.frontend_slot": slot})
    # Not made the global provider: FastAPI's own spans (fastapi.endpoint, a second server span) would
    # double every request's tree and its export cost; the spans above already cover the route.
    return RequestSpans(provider.get_tracer("shmgate.gateway"), slot)


def traced_app(app: Any, spans: RequestSpans, *, access_log: bool) -> ASGIApp:
    """``app`` (an ASGI app: uvicorn's ``config.app``) wrapped in the server-span middleware.

    With ``access_log`` each access log line ends with ``trace_id=<32 hex>`` (``-`` for an untraced
    path), so a log line leads to its trace. Call after uvicorn configured its loggers.
    """
    if access_log:
        _tag_access_log()
    return spans.middleware(app)


class _TraceIdFilter(logging.Filter):
    """Puts the current trace id on each access log record (uvicorn logs it inside the request's context)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from opentelemetry import trace

        ctx = trace.get_current_span().get_span_context()
        record.trace_id = f"{ctx.trace_id:032x}" if ctx.is_valid else "-"
        return True


def _tag_access_log() -> None:
    """Append ``trace_id=%(trace_id)s`` to the access log's format, and the filter that fills it in.

    uvicorn's AccessFormatter formats from the record's fields, not its message, so the id goes into
    the format of each handler it configured.
    """
    logger = logging.getLogger(ACCESS_LOGGER)
    logger.addFilter(_TraceIdFilter())
    for handler in logger.handlers:
        formatter = handler.formatter
        fmt = getattr(formatter, "_fmt", None)
        if formatter is None or not fmt or "trace_id" in fmt:
            continue
        try:
            handler.setFormatter(type(formatter)(fmt + " trace_id=%(trace_id)s", formatter.datefmt))
        except TypeError:  # a formatter class with another signature: keep it as it is
            continue
