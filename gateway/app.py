"""The HTTP surface of one frontend process: routes and lifespan.

Routes:
    POST /v1/chat/completions   OpenAI chat, streaming (SSE) or not
    POST /v1/embeddings         OpenAI embeddings of images (and text, for CLIP-class models): gateway/embeddings.py
    GET  /v1/models             the served model
    GET  /health                this process is up and attached (always open)
    GET  /ready                 a worker for the model heartbeats and we are not draining
    GET  /version               the shmgate version serving (always open)
    GET  /metrics               Prometheus text for the whole node (optionally behind the key)
    GET  /openapi.json          every route's request and answers, errors included (gateway/openapi.py)
    GET  /docs                  that document as an interactive page (Swagger UI; always open)

Every error is an OpenAI error object with the right status (gateway/http_errors.py).
Every response carries ``x-shmgate-frontend: <slot>``, the frontend process that
answered it: all frontends share one port, so this is how an operator (or a fault
test) tells which process served a connection.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.chat_route import chat_completions
from gateway.embeddings import embeddings_route
from gateway.frontend import Frontend
from gateway.guards import AllowedHosts, CatchAll
from gateway.http_errors import error_body, error_response
from gateway.metrics import FrontendStats, exposition
from gateway.openapi import docs_page, openapi_document
from gateway.preprocess import get_preprocessor
from gateway.result_cache import ResultCache
from gateway.served import AppOptions, Served, read_body, served
from gateway.tokenize import detokenize, model_card, tokenize
from shared.errors import EXIT_CONFIG, ShmgateError, UnknownModel
from shared.flags import version
from shared.instance import Instance
from shared.transport import PosixFrontendLink, PosixNodeStats
from shared.vocabulary import check_model_id

__all__ = ["AppOptions", "create_app"]

log = logging.getLogger("shmgate.app")


def create_app(options: AppOptions) -> FastAPI:
    """The frontend's ASGI app: middleware, error handlers and routes; state arrives with the lifespan."""
    # redirect_slashes off: a trailing slash is a 404, never a 307 whose Location is built from the Host header.
    # openapi_url off: FastAPI's generated document knows nothing of bodies the routes decode themselves.
    app = FastAPI(title="shmgate", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.state.options = options
    app.state.served = None
    # Outermost last: the frontend header goes on every response, the catch-all's 500 and the Host refusal included.
    stats = functools.partial(_frontend_stats, app)
    app.add_middleware(AllowedHosts, hosts=options.allowed_hosts, stats=stats)
    app.add_middleware(CatchAll, stats=stats)
    app.add_middleware(FrontendHeader, slot=options.slot)
    app.add_exception_handler(ShmgateError, _shmgate_error)
    app.add_exception_handler(404, _not_found)
    app.add_exception_handler(405, _not_allowed)
    app.add_api_route("/openapi.json", _openapi, methods=["GET"], include_in_schema=False)
    app.add_api_route("/docs", _docs, methods=["GET"], include_in_schema=False)
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/version", _version, methods=["GET"])
    app.add_api_route("/ready", _ready, methods=["GET"])
    app.add_api_route("/v1/models", _models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", _model, methods=["GET"])
    app.add_api_route("/tokenize", _tokenize, methods=["POST"])
    app.add_api_route("/detokenize", _detokenize, methods=["POST"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/embeddings", embeddings_route, methods=["POST"])
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    options: AppOptions = app.state.options
    try:
        preprocessor = get_preprocessor(options.model, max_images=options.intake.max_images,
                                        processor_kwargs=options.processor_kwargs)
        if options.served_model_name:
            preprocessor.model = options.served_model_name
        check_model_id(preprocessor.model)
    except (ValueError, OSError, ImportError) as exc:
        # A configuration error (unknown model, missing model directory, a missing extra):
        # restarting cannot fix it, so say why and exit with the code that makes the
        # supervisor stop instead of restarting us every few seconds.
        print(f"shmgate frontend: configuration error: {exc}", file=sys.stderr, flush=True)
        os._exit(EXIT_CONFIG)
    instance = Instance.attach(options.instance_id)
    frontend = Frontend(PosixFrontendLink(instance, options.slot), preprocessor, options.limits)
    node = PosixNodeStats(instance)
    await frontend.start()
    results = ResultCache(options.result_cache_bytes) if options.result_cache_bytes > 0 else None
    app.state.served = Served(options, frontend, node, results)
    try:
        yield
    finally:
        await frontend.stop()
        instance.close()


def _frontend_stats(app: FastAPI) -> FrontendStats | None:
    """The frontend's counters, for the guards; None before the lifespan attached it."""
    state: Served | None = app.state.served
    return state.frontend.stats if state is not None else None


async def _shmgate_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ShmgateError)  # registered for ShmgateError only
    return error_response(exc)


async def _not_found(request: Request, exc: Exception) -> Response:
    return JSONResponse(error_body("no such route", "invalid_request_error", "not_found"), status_code=404)


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return JSONResponse(error_body("method not allowed", "invalid_request_error", "method_not_allowed"),
                        status_code=405)


@functools.cache
def _openapi_response() -> JSONResponse:
    """Built once; the same bytes for every request."""
    return JSONResponse(openapi_document())


async def _openapi() -> Response:
    return _openapi_response()


@functools.cache
def _docs_response() -> Response:
    """Built once, like the document it shows."""
    return docs_page()


async def _docs() -> Response:
    return _docs_response()


async def _health() -> dict[str, str]:
    return {"status": "ok"}


async def _version() -> dict[str, str]:
    return {"version": version()}


async def _ready(request: Request) -> Response:
    if served(request).frontend.ready():
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "not ready"}, status_code=503, headers={"Retry-After": "1"})


async def _models(request: Request) -> dict[str, object]:
    s = served(request)
    s.check_key(request)
    return {
        "object": "list",
        "data": [model_card(s.frontend.preprocessor)],
    }


async def _tokenize(request: Request) -> Response:
    s = served(request)
    f, options = s.frontend, s.options
    try:
        s.check_key(request)
        body = await read_body(request, options.max_body_bytes)
        return JSONResponse(await tokenize(f.preprocessor, body, options.intake, options.image_urls,
                                           f.limits.max_pixels))
    except ShmgateError as exc:
        return error_response(exc)


async def _detokenize(request: Request) -> Response:
    s = served(request)
    try:
        s.check_key(request)
        return JSONResponse(await detokenize(s.frontend.preprocessor,
                                             await read_body(request, s.options.max_body_bytes)))
    except ShmgateError as exc:
        return error_response(exc)


async def _metrics(request: Request) -> Response:
    s = served(request)
    if s.options.metrics_need_key:
        s.check_key(request)
    body, content_type = exposition(s.node, s.frontend.queue_depth, request.headers.get("accept"))
    return Response(body, headers={"Content-Type": content_type})


async def _model(model_id: str, request: Request) -> dict[str, object]:
    """One model's card (``client.models.retrieve``); ids may hold a slash (``org/name``)."""
    s = served(request)
    s.check_key(request)
    card = model_card(s.frontend.preprocessor)
    if model_id != card["id"]:
        raise UnknownModel(f"model {model_id[:100]!r} is not served here; send {card['id']!r} "
                           "(GET /v1/models lists it)", param="model")
    return card


class FrontendHeader:
    """Pure ASGI middleware adding ``x-shmgate-frontend`` to every HTTP response (a few µs; no body buffering)."""

    def __init__(self, app: ASGIApp, slot: int) -> None:
        self.app = app
        self.header = (b"x-shmgate-frontend", str(slot).encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)
