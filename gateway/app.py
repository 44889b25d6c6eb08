"""The HTTP surface of one frontend process: routes and lifespan.

Routes:
    POST /v1/chat/completions   OpenAI chat, streaming (SSE) or not
    POST /v1/embeddings         OpenAI embeddings of images (and text, for CLIP-class models): gateway/embeddings.py
    POST /v1/responses          OpenAI Responses API, streaming or not (no response store): gateway/responses.py
    GET  /v1/models             the served models, each with its state and capabilities
    GET  /health                this process is up and attached (always open)
    GET  /ready                 every model has a worker that heartbeats, and we are not draining (its body
                                also says whether the Batch API's store can write: ``batches``)
    GET  /ready/{model}         the same for one model (also ``/ready?model=ID``), for per-model probes
    GET  /version               the shmgate version serving (always open)
    GET  /metrics               Prometheus text for the whole node (optionally behind the key)
    GET  /openapi.json          every route's request and answers, errors included (gateway/openapi.py)
    GET  /docs                  that document as an interactive page (Swagger UI; always open)

Every error is an OpenAI error object with the right status (gateway/http_errors.py), counted by its
outcome (gateway/edge.py). The model endpoints' routes come from their table (gateway/endpoints.py).
Every response carries ``x-shmgate-frontend: <slot>``, the frontend process that
answered it: all frontends share one port, so this is how an operator (or a fault
test) tells which process served a connection.
"""

from __future__ import annotations

import functools
import logging
import os
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shmgate.gateway.batch_routes import add_batch_routes
from shmgate.gateway.batch_runner import BatchRunner
from shmgate.gateway.batch_store import BatchStore
from shmgate.gateway.edge import error_answer
from shmgate.gateway.endpoints import ENDPOINTS, MODEL_PATHS
from shmgate.gateway.frontend import Frontend
from shmgate.gateway.guards import AllowedHosts, CatchAll
from shmgate.gateway.http_errors import error_body, error_response
from shmgate.gateway.lane import BulkLane
from shmgate.gateway.metrics import BatchCollector, FrontendStats, ModelGauges, exposition
from shmgate.gateway.openapi import docs_page, openapi_document
from shmgate.gateway.preprocess import get_preprocessor
from shmgate.gateway.result_cache import ResultCache
from shmgate.gateway.served import AppOptions, Served, read_body, served
from shmgate.gateway.tokenize import detokenize, model_card, tokenize
from shmgate.shared.cache import ModelShare
from shmgate.shared.errors import EXIT_CONFIG, ShmgateError
from shmgate.shared.flags import version
from shmgate.shared.instance import Instance
from shmgate.shared.model_config import ModelConfig
from shmgate.shared.segment import ModelState
from shmgate.shared.transport import PosixFrontendLink, PosixNodeStats
from shmgate.shared.vocabulary import check_model_id

if TYPE_CHECKING:
    from shmgate.gateway.request_spans import RequestSpans

__all__ = ["AppOptions", "create_app"]

# /v1/models's ``created`` when the supervisor did not say when the node started (an app built alone)
_STARTED = int(time.time())

log = logging.getLogger("shmgate.app")


def create_app(options: AppOptions, spans: RequestSpans | None = None) -> FastAPI:
    """The frontend's ASGI app: middleware, error handlers and routes; state arrives with the lifespan.

    ``spans``: this frontend's tracing hooks (gateway/tracing.py ``start_tracing``), None when it is off.
    """
    # redirect_slashes off: a trailing slash is a 404, never a 307 whose Location is built from the Host header.
    # openapi_url off: FastAPI's generated document knows nothing of bodies the routes decode themselves.
    app = FastAPI(
        title="shmgate", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False
    )
    app.state.options = options
    app.state.spans = spans
    app.state.served = None
    app.state.batches = None
    # Outermost last: the frontend header goes on every response, the catch-all's 500 and the Host refusal included.
    stats = functools.partial(_frontend_stats, app)
    app.add_middleware(
        BulkLane, paths=MODEL_PATHS, stats=stats
    )  # innermost: interactive model requests are the demand batches yield to
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
    app.add_api_route("/ready/{model_id:path}", _model_ready, methods=["GET"])
    app.add_api_route("/v1/models", _models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", _model, methods=["GET"])
    app.add_api_route("/tokenize", _tokenize, methods=["POST"])
    app.add_api_route("/detokenize", _detokenize, methods=["POST"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    for endpoint in ENDPOINTS:
        app.add_api_route(endpoint.path, endpoint.route, methods=["POST"])
    add_batch_routes(app)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    options: AppOptions = app.state.options
    models = options.models or (
        ModelConfig(options.model, options.served_model_name, mm_processor_kwargs=options.processor_kwargs or {}),
    )
    try:
        preprocessors = []
        for model in models:
            preprocessor = get_preprocessor(
                model.model,
                max_images=options.intake.max_images,
                processor_kwargs=model.mm_processor_kwargs or None,
                tool_chat_template=options.tool_chat_template,  # tools
            )
            if model.served_model_name:
                preprocessor.model = model.served_model_name
            check_model_id(preprocessor.model)
            preprocessors.append(preprocessor)
    except (ValueError, OSError, ImportError) as exc:
        # A configuration error (unknown model, missing model directory, a missing extra):
        # restarting cannot fix it, so say why and exit with the code that makes the
        # supervisor stop instead of restarting us every few seconds.
        print(f"shmgate frontend: configuration error: {exc}", file=sys.stderr, flush=True)
        os._exit(EXIT_CONFIG)
    instance = Instance.attach(options.instance_id)
    link = PosixFrontendLink(instance, options.slot)
    shares = {i: m.arena_share for i, m in enumerate(models) if m.arena_share is not None}
    frontend = Frontend(
        link,
        preprocessors,
        options.limits,
        model_in_flight={
            pre.model: m.max_in_flight for pre, m in zip(preprocessors, models) if m.max_in_flight is not None
        },
        model_failed=functools.partial(_model_failed, instance),
        model_cache=functools.partial(_model_share, link, shares) if shares else None,
    )
    node = PosixNodeStats(instance)
    await frontend.start()
    results = ResultCache(options.result_cache_bytes) if options.result_cache_bytes > 0 else None
    app.state.served = Served(options, frontend, node, results, app.state.spans)
    runner = None
    if options.batch_dir:
        try:
            app.state.batches = BatchStore(options.batch_dir)
        except (OSError, sqlite3.Error) as exc:
            if options.batch_dir_given:
                print(f"shmgate frontend: --batch-dir {options.batch_dir}: {exc}", file=sys.stderr, flush=True)
                os._exit(EXIT_CONFIG)
            # the default directory (a read-only home, say): serve without the Batch API rather than not at all
            log.warning("the Batch API is off: cannot open %s (%s); set --batch-dir", options.batch_dir, exc)
        if app.state.batches is not None:
            runner = BatchRunner(
                app.state.batches, app.state.served, options.batch_max_in_flight, interactive=node.interactive_in_flight
            )
            runner.start()
    try:
        yield
    finally:
        if runner is not None:
            await runner.stop()
        if app.state.batches is not None:  # batch store: its idle connection (gateway/batch_store.py)
            app.state.batches.close()
        await frontend.stop()
        instance.close()


def _model_share(link: PosixFrontendLink, shares: dict[int, float], model_index: int) -> ModelShare:
    """Model ``model_index``'s view of the frontend's cache, the arena shares set (shared/cache.py)."""
    cache = link.content_cache()
    cache.set_shares(shares)
    return ModelShare(cache, model_index)


def _model_gauges(f: Frontend) -> list[ModelGauges]:
    """Each served model's queue depth and ready workers, in model-table order (for /metrics)."""
    depths: dict[str, int] = getattr(f.link, "model_queue_depths", dict)()  # the POSIX link's; none in memory
    return [ModelGauges(model, depths.get(model, 0), f.ready_workers(model)) for model in f.preprocessors]


def _model_failed(instance: Instance, model: str) -> bool:
    """Did the supervisor mark ``model`` failed (its workers died beyond their restart budget)?"""
    index = instance.segment.model_index(model)
    return (
        index >= 0
        and bool(instance.segment.served_models)
        and (instance.segment.model_state(index) == ModelState.FAILED)
    )


def _frontend_stats(app: FastAPI) -> FrontendStats | None:
    """The frontend's counters, for the guards; None before the lifespan attached it."""
    state: Served | None = app.state.served
    return state.frontend.stats if state is not None else None


async def _shmgate_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ShmgateError)  # registered for ShmgateError only
    if request.app.state.served is None:  # before the lifespan attached the frontend: nothing to count in
        return error_response(exc)
    return error_answer(request, exc)


async def _not_found(request: Request, exc: Exception) -> Response:
    return JSONResponse(error_body("no such route", "invalid_request_error", "not_found"), status_code=404)


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return JSONResponse(
        error_body("method not allowed", "invalid_request_error", "method_not_allowed"), status_code=405
    )


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
    model = request.query_params.get("model")
    if model is not None:
        return await _model_ready(model, request)
    f = served(request).frontend
    # batch store: whether it can write; it never makes the node unready (interactive requests are served)
    store: BatchStore | None = request.app.state.batches
    batches = {} if store is None else {"batches": store.health()}
    if f.ready():
        return JSONResponse({"status": "ready", **batches})
    states = {model: model_state(f, model) for model in f.preprocessors}
    waiting = [model for model, state in states.items() if state != "ready"]
    return JSONResponse(
        {
            "status": "not ready",
            "message": _waiting_for(states),
            "waiting_for": [] if f.draining() else waiting,
            "models": states,
            **batches,
        },
        status_code=503,
        headers={"Retry-After": "1"},
    )


_WAITING = {
    "loading": "no worker of model {model!r} is ready yet (starting, loading its weights, or restarting)",
    "failed": "model {model!r} failed: its workers kept dying and are not restarted (the supervisor's log says why)",
}


def _waiting_for(states: dict[str, str]) -> str:
    """What a not-ready node waits for, in one line: each model without a ready worker, or the drain."""
    if "draining" in states.values():
        return "the node is draining (shutting down): it takes no new requests"
    return "; ".join(_WAITING[state].format(model=model) for model, state in states.items() if state != "ready")


async def _model_ready(model_id: str, request: Request) -> Response:
    """One model's readiness (a probe for one model's clients); 404 for a model not served here."""
    f = served(request).frontend
    f.preprocessor_for(model_id)
    state = model_state(f, model_id)
    if state == "ready":
        return JSONResponse({"status": "ready", "model": model_id})
    return JSONResponse(
        {"status": "not ready", "model": model_id, "state": state}, status_code=503, headers={"Retry-After": "1"}
    )


def model_state(f: Frontend, model: str) -> str:
    """``ready`` (a worker serves it), ``loading`` (none yet), ``failed`` (beyond its restart budget), or
    ``draining`` (the node is shutting down)."""
    if f.draining():
        return "draining"
    if f.model_ready(model):
        return "ready"
    return "failed" if f.model_failed(model) else "loading"


def _card(f: Frontend, model: str, created: int) -> dict[str, object]:
    """A model's ``/v1/models`` entry: its card plus its state and what it can do."""
    pre = f.preprocessors[model]
    card = model_card(pre, created)
    card["state"] = model_state(f, model)
    card["capabilities"] = {
        "chat": pre.serves_chat,
        "embeddings": pre.embedding_dim is not None,
        "tokenize": bool(pre.tokenizes and pre.serves_chat),
        "max_model_len": pre.max_prompt_tokens,
    }
    card["endpoints"] = [
        endpoint.path for endpoint in ENDPOINTS if endpoint.serves(pre)
    ]  # the model endpoints it serves
    return card


async def _models(request: Request) -> dict[str, object]:
    s = served(request)
    s.check_key(request)
    return {
        "object": "list",
        "data": [_card(s.frontend, model, s.options.created or _STARTED) for model in s.frontend.preprocessors],
    }


async def _tokenize(request: Request) -> Response:
    s = served(request)
    f, options = s.frontend, s.options
    try:
        s.check_key(request)
        body = await read_body(request, options.max_body_bytes)
        return JSONResponse(
            await tokenize(
                f.preprocessor_for,
                body,
                options.intake,
                options.image_urls,
                f.limits.max_pixels,
                f.images.decode_budget,
            )
        )
    except ShmgateError as exc:
        return error_answer(request, exc)


async def _detokenize(request: Request) -> Response:
    s = served(request)
    try:
        s.check_key(request)
        return JSONResponse(
            await detokenize(s.frontend.preprocessor_for, await read_body(request, s.options.max_body_bytes))
        )
    except ShmgateError as exc:
        return error_answer(request, exc)


async def _metrics(request: Request) -> Response:
    s = served(request)
    if s.options.metrics_need_key:
        s.check_key(request)
    store: BatchStore | None = request.app.state.batches
    body, content_type = exposition(
        s.node,
        s.frontend.queue_depth,
        request.headers.get("accept"),
        functools.partial(_model_gauges, s.frontend),
        None if store is None or store.damage else BatchCollector(store.line_counts, s.frontend.preprocessors),
        s.frontend.stages.exemplars,
    )
    return Response(body, headers={"Content-Type": content_type})


async def _model(model_id: str, request: Request) -> dict[str, object]:
    """One model's card (``client.models.retrieve``); ids may hold a slash (``org/name``)."""
    s = served(request)
    s.check_key(request)
    s.frontend.preprocessor_for(model_id)  # UnknownModel (404) for a model not served here
    return _card(s.frontend, model_id, s.options.created or _STARTED)


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
