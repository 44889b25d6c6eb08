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

Every error is an OpenAI error object with the right status (gateway/http_errors.py).
Every response carries ``x-shmgate-frontend: <slot>``, the frontend process that
answered it: all frontends share one port, so this is how an operator (or a fault
test) tells which process served a connection.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.choices import answer_choices
from gateway.embeddings import embed, embedding_response, parse_embedding_request
from gateway.fetch import FetchPolicy, fetch_pending
from gateway.fields import check_fields_for_model, set_image_options
from gateway.frontend import Frontend, FrontendLimits, RequestState
from gateway.guards import AllowedHosts, CatchAll, require_json
from gateway.http_errors import count_error, error_body, error_response
from gateway.http_errors import failure_error as _failure
from gateway.http_limits import read_capped
from gateway.intake import IntakeLimits, key_material, parse_chat_request
from gateway.metrics import Counter, FrontendStats, exposition
from gateway.openapi import openapi_document
from gateway.preprocess import get_preprocessor
from gateway.result_cache import ResultCache, answer_key, keyed_off_the_loop
from gateway.sse import Completion, logprob_entry
from gateway.stages import server_timing
from gateway.tokenize import detokenize, model_card, tokenize
from shared.errors import EXIT_CONFIG, Cancelled, InvalidRequest, RequestTooLarge, ShmgateError, Unauthorized
from shared.flags import version
from shared.instance import Instance
from shared.stages import Stage
from shared.transport import PosixFrontendLink, PosixNodeStats
from shared.vocabulary import check_model_id
from shared.wire import Delta, Failed, Finished, TokenLogprobs, Vector, failed_reply

__all__ = ["AppOptions", "create_app"]

log = logging.getLogger("shmgate.app")


@dataclass(frozen=True)
class AppOptions:
    instance_id: str
    slot: int
    model: str
    api_key: str | None = None
    metrics_need_key: bool = False
    max_body_bytes: int = 32 << 20
    intake: IntakeLimits = IntakeLimits()
    limits: FrontendLimits = FrontendLimits()
    image_urls: FetchPolicy = field(default_factory=FetchPolicy)  # used only when intake.allow_image_urls is set
    result_cache_bytes: int = 0  # deterministic answers kept per frontend (gateway/result_cache.py); 0: off
    processor_kwargs: dict[str, Any] | None = None  # --mm-processor-kwargs (hf: models)
    server_timing: bool = False  # --server-timing: per-stage durations in a Server-Timing header
    allowed_hosts: tuple[str, ...] = ("*",)  # --allowed-hosts: Host header names answered (gateway/guards.py)


def create_app(options: AppOptions) -> FastAPI:
    frontend_box: dict[str, Frontend] = {}
    node_box: dict[str, PosixNodeStats] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            preprocessor = get_preprocessor(options.model, max_images=options.intake.max_images,
                                            processor_kwargs=options.processor_kwargs)
            check_model_id(preprocessor.model)
        except (ValueError, OSError, ImportError) as exc:
            # A configuration error (unknown model, missing model directory, a missing extra):
            # restarting cannot fix it, so say why and exit with the code that makes the
            # supervisor stop instead of restarting us every few seconds.
            print(f"shmgate frontend: configuration error: {exc}", file=sys.stderr, flush=True)
            os._exit(EXIT_CONFIG)
        instance = Instance.attach(options.instance_id)
        frontend = Frontend(PosixFrontendLink(instance, options.slot), preprocessor, options.limits)
        node_box["n"] = PosixNodeStats(instance)
        await frontend.start()
        frontend_box["f"] = frontend
        try:
            yield
        finally:
            await frontend.stop()
            instance.close()

    # redirect_slashes off: a trailing slash is a 404, never a 307 whose Location is built from the Host header.
    # openapi_url off: FastAPI's generated document knows nothing of bodies the routes decode themselves.
    app = FastAPI(title="shmgate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    # Outermost last: the frontend header goes on every response, the catch-all's 500 and the Host refusal included.
    def stats() -> FrontendStats | None:
        """The frontend's counters, for the guards; None before the lifespan attached it."""
        return frontend_box["f"].stats if "f" in frontend_box else None

    app.add_middleware(AllowedHosts, hosts=options.allowed_hosts, stats=stats)
    app.add_middleware(CatchAll, stats=stats)
    app.add_middleware(FrontendHeader, slot=options.slot)

    def frontend() -> Frontend:
        return frontend_box["f"]

    def check_key(request: Request) -> None:
        if options.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), options.api_key.encode()):
            raise Unauthorized("missing or invalid API key; send 'Authorization: Bearer <key>'")

    @app.exception_handler(ShmgateError)
    async def _shmgate_error(request: Request, exc: ShmgateError) -> Response:
        return error_response(exc)

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> Response:
        return JSONResponse(error_body("no such route", "invalid_request_error", "not_found"), status_code=404)

    @app.exception_handler(405)
    async def _not_allowed(request: Request, exc: Exception) -> Response:
        return JSONResponse(error_body("method not allowed", "invalid_request_error", "method_not_allowed"),
                            status_code=405)

    document = JSONResponse(openapi_document())  # built once; the same bytes for every request

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> Response:
        return document

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/version")
    async def version_route() -> dict[str, str]:
        return {"version": version()}

    @app.get("/ready")
    async def ready() -> Response:
        if frontend().ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready"}, status_code=503, headers={"Retry-After": "1"})

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, object]:
        check_key(request)
        return {
            "object": "list",
            "data": [model_card(frontend().preprocessor)],
        }

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        f = frontend()
        try:
            check_key(request)
            body = await _read_body(request, options.max_body_bytes)
            return JSONResponse(await tokenize(f.preprocessor, body, options.intake, options.image_urls,
                                               f.limits.max_pixels))
        except ShmgateError as exc:
            return error_response(exc)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        try:
            check_key(request)
            return JSONResponse(await detokenize(frontend().preprocessor,
                                                 await _read_body(request, options.max_body_bytes)))
        except ShmgateError as exc:
            return error_response(exc)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if options.metrics_need_key:
            check_key(request)
        f = frontend()
        body, content_type = exposition(node_box["n"], f.queue_depth, request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    results = ResultCache(options.result_cache_bytes) if options.result_cache_bytes > 0 else None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        f = frontend()
        started = time.monotonic()
        keep: Callable[[Finished, str], None] | None = None
        try:
            check_key(request)
            body = await _read_body(request, options.max_body_bytes)
            read_s = time.monotonic() - started
            f.stages.observe(Stage.BODY_READ, read_s)
            chat = parse_chat_request(body, options.intake)
            check_fields_for_model(chat.params, f.preprocessor, chat.n)
            set_image_options(chat, f.preprocessor)
            if not getattr(f.preprocessor, "serves_chat", True):
                raise InvalidRequest(f"{f.preprocessor.model} is an embedding model; use POST /v1/embeddings",
                                     param="model")
            if chat.pending_urls:
                await fetch_pending(chat, options.image_urls)
            key = None
            if results is not None:
                key = await keyed_off_the_loop(sum(len(key_material(i)) for i in chat.images),
                                               functools.partial(answer_key, chat, f.preprocessor))
            if results is not None and key is not None:
                cached = None if _bypass_cache(request) else results.get(key)
                f.stats.set_result_cache(results.stats, results.used_bytes)
                if cached is not None:
                    return _cached_answer(f, chat.model, chat.stream, chat.include_usage, cached, started)
                keep = functools.partial(_keep_answer, f, results, key)
            if chat.n > 1:
                return await answer_choices(f, chat, started)
            state = await f.submit(chat)
        except ShmgateError as exc:
            count_error(f.stats, exc)
            return error_response(exc)
        state.timing.spent[Stage.BODY_READ] = read_s
        logprobs = chat.params.logprobs >= 0
        if chat.stream:
            return await _stream(f, state, chat.model, chat.include_usage, started, keep, logprobs=logprobs,
                                 receive=request.receive)
        return await _complete(f, state, chat.model, started, keep, logprobs=logprobs,
                               timing_header=options.server_timing, receive=request.receive)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        f = frontend()
        started = time.monotonic()
        try:
            check_key(request)
            body = await _read_body(request, options.max_body_bytes)
            f.stages.observe(Stage.BODY_READ, time.monotonic() - started)
            job = parse_embedding_request(body, options.intake, f.preprocessor)
            if job.chat.pending_urls:
                await fetch_pending(job.chat, options.image_urls)
            try:
                vectors, tokens = await embed(f, job, results, bypass_cache=_bypass_cache(request))
            finally:
                if results is not None:
                    f.stats.set_result_cache(results.stats, results.used_bytes)
        except ShmgateError as exc:
            count_error(f.stats, exc)
            return error_response(exc)
        f.stats.add(Counter.REQUESTS_OK)
        f.stats.observe(Counter.LATENCY_BUCKETS, time.monotonic() - started)
        return Response(embedding_response(job, vectors, tokens), media_type="application/json")

    return app


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


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes.

    Raises RequestTooLarge, InvalidRequest (empty), and Cancelled when the client closed the
    connection before the whole body arrived: that is a hang-up, answered (to nobody) and counted
    like any other error instead of escaping to uvicorn, which would log a traceback for each one.
    """
    require_json(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    try:
        body = await read_capped(declared, request.stream(), limit, "the request body", RequestTooLarge)
    except ClientDisconnect:
        raise Cancelled("the client closed the connection before sending the whole body") from None
    if not body:
        raise InvalidRequest("the request body is empty; send a JSON chat completion request")
    return body


def _bypass_cache(request: Request) -> bool:
    """``Cache-Control: no-cache``: compute the answer afresh (it is still stored)."""
    return "no-cache" in request.headers.get("cache-control", "").lower()


def _keep_answer(f: Frontend, results: ResultCache, key: bytes, event: Finished, text: str) -> None:
    """Store a completed deterministic answer in the result cache."""
    results.put(key, msgspec.msgpack.encode((text, event.finish_reason, event.prompt_tokens,
                                             event.completion_tokens)))
    f.stats.set_result_cache(results.stats, results.used_bytes)


def _cached_answer(f: Frontend, model: str, stream: bool, include_usage: bool, cached: bytes,
                   started: float) -> Response:
    """A result-cache hit, answered as the model would have (one content chunk when streaming)."""
    text, finish_reason, prompt_tokens, completion_tokens = msgspec.msgpack.decode(cached)
    completion = Completion(model)
    f.stats.add(Counter.REQUESTS_OK)
    f.stats.observe(Counter.LATENCY_BUCKETS, time.monotonic() - started)
    f.stats.observe(Counter.TTFT_BUCKETS, time.monotonic() - started)
    if not stream:
        return JSONResponse(completion.completion(text, finish_reason, prompt_tokens, completion_tokens))
    chunks = [completion.role_chunk(), completion.content_chunk(text), completion.finish_chunk(finish_reason)]
    if include_usage:
        chunks.append(completion.usage_chunk(prompt_tokens, completion_tokens))
    chunks.append(completion.done())
    return Response(b"".join(chunks), media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _cancel_on_hang_up(f: Frontend, state: RequestState, receive: Receive | None) -> asyncio.Task[None] | None:
    """Watch the connection while nothing is written to it: a hang-up cancels the request's work.

    Without this a client that goes away is noticed only when output is written to it, so a
    non-streamed answer (or a stream before its first event) is computed to the end for nobody.
    The body has been read, so the next ASGI message is ``http.disconnect``: uvicorn sends it when
    the connection is lost (or once a response is complete, which is why the caller cancels this
    task before answering). On a hang-up the request is abandoned (counted ``cancelled``; a Cancel
    reaches its worker, which stops at its next step; its arena holds go back when the worker's
    terminal message arrives) and a ``cancelled`` Failed wakes the waiting caller, which ends at
    once without counting it again. One task per request, asleep until the connection closes.
    """
    if receive is None:
        return None

    async def watch() -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # a server whose receive cannot be read again: no watch, as before
            return
        if not state.done:
            f.abandon(state)
            state.events.put_nowait(failed_reply(state.request_id, 0, Cancelled("the client hung up")))

    return asyncio.get_running_loop().create_task(watch())


async def _complete(f: Frontend, state: RequestState, model: str, started: float,
                    keep: Callable[[Finished, str], None] | None = None, *, logprobs: bool = False,
                    timing_header: bool = False, receive: Receive | None = None) -> Response:
    """The whole answer in one JSON body; with ``timing_header``, where its time went (``Server-Timing``).

    ``receive`` (the request's ASGI receive, its body already read) lets a hang-up cancel the work.
    """
    completion = Completion(model)
    parts: list[str] = []
    entries: list[dict[str, Any]] | None = [] if logprobs else None
    watcher = _cancel_on_hang_up(f, state, receive)
    try:
        async for event in f.events(state):
            if isinstance(event, TokenLogprobs):
                if entries is not None:
                    entries.append(logprob_entry(event.entry))
            elif isinstance(event, Delta):
                parts.append(event.text)
            elif isinstance(event, Failed):
                if event.code == Cancelled.code:  # the client hung up (counted by abandon)
                    return Response(status_code=Cancelled.status_hint)  # nobody reads it
                error = _failure(event)
                count_error(f.stats, error)
                return error_response(error)
            elif isinstance(event, Finished):
                elapsed = time.monotonic() - started
                if keep is not None:
                    keep(event, "".join(parts))
                f.stats.add(Counter.REQUESTS_OK)
                f.stats.observe(Counter.LATENCY_BUCKETS, elapsed)
                f.stats.observe(Counter.TTFT_BUCKETS, elapsed)
                f.stages.delivered(state.timing)
                headers = {"Server-Timing": server_timing(state.timing, elapsed)} if timing_header else None
                return JSONResponse(
                    completion.completion("".join(parts), event.finish_reason, event.prompt_tokens,
                                          event.completion_tokens, entries),
                    headers=headers,
                )
    finally:
        if watcher is not None:
            watcher.cancel()
        if not state.done:
            f.abandon(state)
    raise AssertionError("events() always ends with Finished or Failed")


async def _stream(f: Frontend, state: RequestState, model: str, include_usage: bool, started: float,
                  keep: Callable[[Finished, str], None] | None = None, *, logprobs: bool = False,
                  receive: Receive | None = None) -> Response:
    """Wait for the first event so an early failure is a proper HTTP error, then stream.

    Until that first event a hang-up cancels the work (``receive``, as in ``_complete``); from
    then on Starlette's StreamingResponse listens for the disconnect itself.
    """
    events = f.events(state).__aiter__()
    watcher = _cancel_on_hang_up(f, state, receive)
    try:
        first = await events.__anext__()
    except (asyncio.CancelledError, Exception):
        f.abandon(state)
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
    if isinstance(first, Failed) and first.code == Cancelled.code:  # the client hung up (counted by abandon)
        return Response(status_code=Cancelled.status_hint)  # nobody reads it
    if isinstance(first, Failed):
        error = _failure(first)
        count_error(f.stats, error)
        return error_response(error)
    completion = Completion(model)

    async def body() -> AsyncIterator[bytes]:
        ttft_seen = False
        parts: list[str] = []
        entries: list[dict[str, Any]] = []  # logprobs of tokens whose text has not been sent yet
        try:
            yield completion.role_chunk()
            event: Delta | Vector | TokenLogprobs | Finished | Failed | None = first
            while event is not None:
                if isinstance(event, TokenLogprobs):
                    entries.append(logprob_entry(event.entry))
                elif isinstance(event, Delta):
                    if not ttft_seen:
                        ttft_seen = True
                        f.stats.observe(Counter.TTFT_BUCKETS, time.monotonic() - started)
                    if keep is not None:
                        parts.append(event.text)
                    yield completion.content_chunk(event.text, entries if logprobs else None)
                    entries = []
                elif isinstance(event, Finished):
                    if entries and logprobs:  # tokens with no text of their own (EOS, a held-back stop)
                        yield completion.content_chunk("", entries)
                    if keep is not None:
                        keep(event, "".join(parts))
                    yield completion.finish_chunk(event.finish_reason)
                    if include_usage:
                        yield completion.usage_chunk(event.prompt_tokens, event.completion_tokens)
                    yield completion.done()
                    f.stages.delivered(state.timing)
                    f.stats.add(Counter.REQUESTS_OK)
                    f.stats.observe(Counter.LATENCY_BUCKETS, time.monotonic() - started)
                    return
                elif isinstance(event, Failed):
                    if event.code == Cancelled.code:  # the client left just as the first event came: counted
                        return
                    error = _failure(event)
                    count_error(f.stats, error)
                    yield completion.error_event(error_body(error.message, error.error_type, error.code))
                    return
                event = await events.__anext__()
        finally:
            if not state.done:
                f.abandon(state)  # the client disconnected mid-stream

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
