"""A frontend's spans: the HTTP server span, its stages, and one span per attempt of each choice.

Imported only when tracing is on (gateway/tracing.py ``start_tracing``): this module imports
OpenTelemetry at the top; the rest of gateway/ reaches it only through the ``RequestSpans`` it is
handed (``Served.spans``, a request's ``RequestContext.spans``).

The tree of one chat request, as this frontend writes it (the worker adds its part under each
attempt, worker/tracing.py):

    POST /v1/chat/completions          SERVER; incoming traceparent/tracestate are its parent
    ├── body_read                      the body arriving (explicit times: the stage's own)
    ├── image_url_fetch                http(s) image URLs fetched (--allow-image-urls)
    ├── preprocess image               per image: decode + preprocess, or a cache hit (shmgate.cache)
    ├── preprocess                     admission -> descriptor built (images, prompt)
    ├── attempt                        per choice and per try: descriptor sent -> its terminal reply
    │   └── queue                      sent -> a worker claimed it
    └── delivery                       the worker's final answer -> the response built

A batch line (gateway/batch_runner.py) is one trace of its own: a ``batch line`` span (INTERNAL;
``shmgate.batch.id``, ``shmgate.batch.custom_id``, ``shmgate.batch.line``) stands where the server
span stands above (the line runs in process, no HTTP request): its stages and attempts are its children.

Stage times come from the stamps the stage histograms already take (gateway/stages.py,
shared/stages.py): ``body_read``, ``preprocess``, ``queue`` and ``delivery`` are made after the fact
with explicit start and end times, so the data path gains no clock reads for them. The spans that
other work happens under are started live: the server span, ``attempt`` (the worker's spans hang
below it), ``image_url_fetch`` and ``preprocess image`` (in the decode pool's thread).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shmgate.shared.errors import Cancelled
from shmgate.shared.tracing import epoch_ns
from shmgate.shared.wire import Claimed, Failed, Finished

__all__ = ["BatchLineTrace", "RequestSpans", "RequestTrace", "TracingMiddleware", "traceparent_of"]

T = TypeVar("T")
PROPAGATOR = TraceContextTextMapPropagator()
TRACED_PATH_PREFIX = "/v1/"  # the API; probes and /metrics would drown every trace store in noise


def traceparent_of(span: Span) -> str:
    """The W3C traceparent naming ``span``: what ``Submit.traceparent`` carries to the worker."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _wall_ns(monotonic_s: float) -> int:
    return epoch_ns(int(monotonic_s * 1e9))


class RequestSpans:
    """This frontend's tracer and the span hooks the data path calls (handed to it with each request)."""

    def __init__(self, tracer: trace.Tracer, slot: int) -> None:
        self.tracer = tracer
        self.slot = slot

    def middleware(self, app: ASGIApp) -> ASGIApp:
        return TracingMiddleware(app, self)

    def stage(self, name: str, started_s: float, seconds: float, **attributes: Any) -> None:
        """A finished stage of the current request as a child span: ``started_s`` is ``time.monotonic()``."""
        start = _wall_ns(started_s)
        span = self.tracer.start_span(name, start_time=start, attributes=attributes or None)
        span.end(end_time=start + int(seconds * 1e9))

    @contextmanager
    def live(self, name: str, **attributes: Any) -> Iterator[Span]:
        """A span around work done right here (``image_url_fetch``); an exception marks it failed."""
        with self.tracer.start_as_current_span(name, attributes=attributes or None) as span:
            yield span

    def image_hit(self, index: int) -> None:
        """An image found in this frontend's content cache on the event loop: no decode at all."""
        now = time.time_ns()
        span = self.tracer.start_span(
            "preprocess image", start_time=now, attributes={"shmgate.image.index": index, "shmgate.cache": "hit"}
        )
        span.end(end_time=now)

    def image_task(self, fn: Callable[..., T], index: int) -> Callable[..., T]:
        """``fn`` (an image's resolution, run in the decode pool) inside a ``preprocess image`` span.

        The pool's threads do not inherit the event loop's context, so the request's context is
        taken here, on the loop, and made current in the thread.
        """
        parent = otel_context.get_current()

        @functools.wraps(fn)
        def traced(*args: Any) -> T:
            with self.tracer.start_as_current_span(
                "preprocess image", context=parent, attributes={"shmgate.image.index": index}
            ):
                return fn(*args)

        return traced

    @staticmethod
    def cache_result(kind: str) -> None:
        """The content cache's answer for the image being resolved: hit, remote (another frontend's) or miss."""
        trace.get_current_span().set_attribute("shmgate.cache", kind)

    def request(self, model: str) -> RequestTrace:
        """One choice's trace: its attempts become children of the current (server) span."""
        return RequestTrace(self, model, otel_context.get_current())

    def batch_line(self, batch_id: str, custom_id: str, index: int) -> BatchLineTrace:
        """A batch line's own span (the runner's, gateway/batch_runner.py), the root of its trace: current
        while the line runs (``BatchLineTrace.current``), it is the parent of the line's request spans."""
        span = self.tracer.start_span(
            "batch line",
            context=Context(),  # a new trace per line, whatever the runner's task context holds
            attributes={
                "shmgate.batch.id": batch_id,
                "shmgate.batch.custom_id": custom_id,
                "shmgate.batch.line": index,
                "shmgate.lane": "bulk",
                "shmgate.frontend_slot": self.slot,
            },
        )
        return BatchLineTrace(span)

    @staticmethod
    def trace_id() -> str:
        """The current request's trace id (32 hex), "" outside a sampled trace."""
        ctx = trace.get_current_span().get_span_context()
        return f"{ctx.trace_id:032x}" if ctx.trace_flags.sampled else ""


class RequestTrace:
    """One choice's attempts, queue wait and delivery (``RequestState.trace``).

    Each attempt is a span from its descriptor's send to its terminal reply (or the retry that
    replaced it), and its context is what the worker receives: a retried request shows every
    attempt, each with the worker spans of the try it was.
    """

    __slots__ = ("_attempt", "_attempt_started_ns", "_parent", "_spans", "_model", "cancelled")

    def __init__(self, spans: RequestSpans, model: str, parent: Context) -> None:
        self._spans = spans
        self._model = model
        self._parent = parent
        self._attempt: Span | None = None
        self._attempt_started_ns = 0
        self.cancelled = False

    def attempt(self, request_id: int, attempt: int) -> str:
        """Open the span of a new try of the request; returns the traceparent its Submit carries."""
        self._attempt_started_ns = time.monotonic_ns()
        span = self._spans.tracer.start_span(
            "attempt",
            context=self._parent,
            start_time=epoch_ns(self._attempt_started_ns),
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.request.model": self._model,
                "shmgate.request_id": f"{request_id:x}",
                "shmgate.attempt": attempt,
                "shmgate.frontend_slot": self._spans.slot,
            },
        )
        self._attempt = span
        return traceparent_of(span)

    def claimed(self, message: Claimed) -> None:
        """A worker took the attempt: the ``queue`` span, sent -> claimed (the worker's stamp)."""
        span = self._attempt
        if span is None:
            return
        span.set_attribute("shmgate.worker_slot", message.worker_slot)
        if message.claimed_ns >= self._attempt_started_ns > 0:
            queue = self._spans.tracer.start_span(
                "queue", context=trace.set_span_in_context(span), start_time=epoch_ns(self._attempt_started_ns)
            )
            queue.end(end_time=epoch_ns(message.claimed_ns))

    def retrying(self, why: str) -> None:
        """The attempt's worker died before any output: the attempt ends failed, the next one follows."""
        self._end(StatusCode.ERROR, f"retried: {why}")

    def abandoned(self) -> None:
        """The client went away: the attempt (and the request) say so."""
        self.cancelled = True
        if self._attempt is not None:
            self._attempt.add_event("cancelled", {"reason": "the client hung up"})
        request = trace.get_current_span(self._parent)
        if request.is_recording():  # a stream's server span may have ended first
            request.set_attribute("shmgate.cancelled", True)

    def ended(self, message: Finished | Failed | None) -> None:
        """The attempt's terminal reply (None: ended here, e.g. a timeout); idempotent."""
        span = self._attempt
        if span is None:
            return
        if isinstance(message, Finished):
            span.set_attributes(
                {
                    "gen_ai.usage.input_tokens": message.prompt_tokens,
                    "gen_ai.usage.output_tokens": message.completion_tokens,
                    "gen_ai.response.finish_reasons": (message.finish_reason,),
                }
            )
            self._end(StatusCode.UNSET, None)
        elif isinstance(message, Failed):
            span.set_attribute("error.type", message.code)
            if message.code == Cancelled.code:
                self.cancelled = True
            self._end(StatusCode.ERROR, message.message)
        else:
            self._end(StatusCode.UNSET, None)

    def _end(self, code: StatusCode, description: str | None) -> None:
        span, self._attempt = self._attempt, None
        if span is None:
            return
        if self.cancelled:
            span.set_attribute("shmgate.cancelled", True)
        if code is StatusCode.ERROR:
            span.set_status(Status(code, description))
        span.end()

    def delivered(self, done_ns: int, ttft_s: float | None) -> None:
        """The response is built: ``delivery``, the worker's final answer (its stamp) -> now."""
        request = trace.get_current_span(self._parent)
        if ttft_s is not None and request.is_recording():
            request.set_attribute("gen_ai.server.time_to_first_token", ttft_s)
        if done_ns <= 0:
            return
        span = self._spans.tracer.start_span("delivery", context=self._parent, start_time=epoch_ns(done_ns))
        span.end()


class BatchLineTrace:
    """One batch line's span, from its first try to its result (tries on 429/503 included)."""

    def __init__(self, span: Span) -> None:
        self.span = span

    @contextmanager
    def current(self) -> Iterator[None]:
        """The line's span as the current span while its request runs (its stages' and attempts' parent)."""
        token = otel_context.attach(trace.set_span_in_context(self.span))
        try:
            yield
        finally:
            otel_context.detach(token)

    def ended(self, status: int | None, error: str | None = None) -> None:
        """The line's outcome: the HTTP status of its answer (as its output line records it), or None and why
        when it got none."""
        if status is not None:
            self.span.set_attribute("http.response.status_code", status)
        if status is None or status >= 500:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()


class TracingMiddleware:
    """The server span of every API request, current while the route runs (and its response streams).

    An incoming ``traceparent``/``tracestate`` (W3C) is the span's parent, so shmgate's spans sit inside
    the caller's trace. Pure ASGI: the span covers the whole response, a stream's last chunk included.
    """

    def __init__(self, app: ASGIApp, spans: RequestSpans) -> None:
        self.app = app
        self.spans = spans

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(TRACED_PATH_PREFIX):
            await self.app(scope, receive, send)
            return
        carrier = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k in (b"traceparent", b"tracestate")
        }
        parent = PROPAGATOR.extract(carrier) if carrier else None
        method, path = scope["method"], scope["path"]
        span = self.spans.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "url.path": path,
                "http.route": path,
                "shmgate.frontend_slot": self.spans.slot,
            },
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))

        async def send_traced(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)

        try:
            await self.app(scope, receive, send_traced)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            span.end()
            otel_context.detach(token)
