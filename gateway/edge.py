"""The HTTP edge of the request pipeline: a route's request in, its response out.

The pipeline (gateway/pipeline.py) takes and returns data; what is HTTP lives here once, for every
model endpoint: the API key, the bounded body, its stage and span, the answer framed (a JSON body,
or server-sent events), a hang-up's 499 (to nobody), and every ShmgateError raised on the way
answered as an OpenAI error object and counted by its outcome (gateway/http_errors.py). The other
routes (models, tokenize, files and batches) answer their errors through ``error_answer``, the same
answer and the same count.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable

import msgspec
from fastapi import Request
from fastapi.responses import Response
from starlette.responses import StreamingResponse

from shmgate.gateway.http_errors import count_error, error_response
from shmgate.gateway.metrics import FrontendStats
from shmgate.gateway.pipeline import Arrival, Steps
from shmgate.gateway.render import Answer, HungUp, Whole
from shmgate.gateway.request_context import RequestContext
from shmgate.gateway.served import Served, bypass_cache, read_body, served
from shmgate.shared.errors import Cancelled, ShmgateError
from shmgate.shared.stages import Stage

__all__ = ["SSE_HEADERS", "error_answer", "framed", "http_response", "respond"]

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def respond(request: Request, steps: Steps) -> Response:
    """Check the key, read the body, run the endpoint's ``steps``, frame their answer (``framed``)."""
    s = served(request)
    return await framed(s.frontend.stats, _arrive(s, request, steps))


async def _arrive(s: Served, request: Request, steps: Steps) -> Answer:
    started = time.monotonic()
    s.check_key(request)
    body = await read_body(request, s.options.max_body_bytes)
    read_s = time.monotonic() - started
    s.frontend.stages.observe(Stage.BODY_READ, read_s)
    if s.spans is not None:
        s.spans.stage("body_read", started, read_s, **{"http.request.body.size": len(body)})
    context = RequestContext(spans=s.spans)  # an HTTP request is interactive
    return await steps(s, Arrival(body, started, read_s, bypass_cache(request), request.receive, context=context))


async def framed(stats: FrontendStats, answering: Awaitable[Answer]) -> Response:
    """The answer ``answering`` comes to, as HTTP; the error it raises as an OpenAI error object.

    A request answered is counted by its answer (gateway/render.py, or the endpoint); one that ends in
    an error is counted here, once; a hang-up was counted when its work was abandoned.
    """
    try:
        return http_response(await answering)
    except HungUp:
        return Response(status_code=Cancelled.status_hint)  # nobody reads it
    except ShmgateError as exc:
        count_error(stats, exc)
        return error_response(exc)


def http_response(answer: Answer) -> Response:
    """An answer as HTTP: a JSON body, or server-sent events (streamed as they come)."""
    if isinstance(answer, Whole):
        return Response(msgspec.json.encode(answer.body), media_type="application/json", headers=answer.headers)
    if isinstance(answer.events, bytes):
        return Response(answer.events, media_type="text/event-stream", headers=SSE_HEADERS | answer.headers)
    return StreamingResponse(answer.events, media_type="text/event-stream", headers=SSE_HEADERS | answer.headers)


def error_answer(request: Request, exc: ShmgateError) -> Response:
    """A route's error as every route answers one: the OpenAI error object, counted by its outcome."""
    count_error(served(request).frontend.stats, exc)
    return error_response(exc)
