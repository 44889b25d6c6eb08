"""The one place where errors become HTTP responses (OpenAI error objects), and where every outcome is counted."""

from __future__ import annotations

import math

from starlette.responses import JSONResponse

from shmgate.gateway.metrics import Counter, FrontendStats
from shmgate.shared.errors import Cancelled, Overloaded, ShmgateError, error_for_code
from shmgate.shared.wire import Failed

__all__ = ["MAX_MESSAGE_CHARS", "capped", "count_error", "count_ok", "error_body", "error_response", "failure_error"]


# An error message may quote what the client sent (msgspec's validation errors quote the offending
# value whole: a 1,000,000-character role came back in a 1 MB 400). Every error body is built by
# ``error_body``, so the bound is kept here: the head says what was wrong, the tail where
# (msgspec ends with "- at `$.messages[0].role`"), and the client's value in between is cut.
MAX_MESSAGE_CHARS = 240
_HEAD_CHARS = 130
_TAIL_CHARS = 70  # head + tail: at most 200 characters of a message survive a cut, all of them input or not
MAX_PARAM_CHARS = 200


def capped(message: str) -> str:
    """``message`` if at most MAX_MESSAGE_CHARS long, else its head and tail around a note of what was cut
    (which keeps it under MAX_MESSAGE_CHARS too: /openapi.json promises that bound)."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    cut = len(message) - _HEAD_CHARS - _TAIL_CHARS
    return f"{message[:_HEAD_CHARS]}... ({cut} characters cut) ...{message[-_TAIL_CHARS:]}"


def error_body(message: str, error_type: str, code: str, param: str | None = None) -> dict[str, object]:
    """The OpenAI error object; the message and param are capped (they may quote client input)."""
    if param is not None and len(param) > MAX_PARAM_CHARS:
        param = param[:MAX_PARAM_CHARS]
    return {"error": {"message": capped(message), "type": error_type, "param": param, "code": code}}


def error_response(exc: ShmgateError) -> JSONResponse:
    headers = {}
    if isinstance(exc, Overloaded) or exc.status_hint in (429, 503):
        retry_after = getattr(exc, "retry_after_s", 1.0)
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return JSONResponse(
        error_body(exc.message, exc.error_type, exc.code, exc.param), status_code=exc.status_hint, headers=headers
    )


def failure_error(event: Failed) -> ShmgateError:
    """A Failed reply as the error the client gets: the class its code names (shared/errors.py), with
    the status the sender gave (an instance may refine its class's, e.g. Overloaded's 429)."""
    error = error_for_code(event.code, event.message)
    error.status_hint = event.status_hint
    if type(error) is ShmgateError and event.status_hint < 500:  # a code this side does not know
        error.error_type = "invalid_request_error"
    return error


def count_error(stats: FrontendStats, exc: ShmgateError) -> None:
    """Count a request that ended in ``exc`` by the outcome its status says (/metrics requests_total)."""
    if isinstance(exc, Cancelled):  # the client went away (e.g. mid-body): not an error of anyone's
        stats.add(Counter.CANCELLED)
    elif exc.status_hint in (429, 503):
        stats.add(Counter.REQUESTS_OVERLOADED)
    elif exc.status_hint < 500:
        stats.add(Counter.REQUESTS_CLIENT_ERROR)
    else:
        stats.add(Counter.REQUESTS_SERVER_ERROR)


def count_ok(stats: FrontendStats, latency_s: float, ttft_s: float | None = None) -> None:
    """Count an answered request: its latency, and its time to first token when it has one.

    A whole (non-streamed) answer's first token reaches the client with the rest, so its TTFT is
    its latency; a stream's is when its first content chunk went out; an embedding has none.
    """
    stats.add(Counter.REQUESTS_OK)
    stats.observe(Counter.LATENCY_BUCKETS, latency_s)
    if ttft_s is not None:
        stats.observe(Counter.TTFT_BUCKETS, ttft_s)
