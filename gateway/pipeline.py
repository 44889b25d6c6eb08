"""One request pipeline for every endpoint: an endpoint is a codec (a parser and a formatter) over it.

What every endpoint does is written here once (DESIGN §4c):

    ``handle``    the API key, the bounded body, its stage and span, and every ShmgateError raised
                  on the way answered as an OpenAI error object and counted by its outcome.
    ``generate``  the steps of a generation (chat completions, responses): the codec parses the body
                  into the engine's request (a ``ChatRequest``: the model, the prompt in the chat
                  template's form, the images, sampling and output constraints, n) and the
                  ``AnswerFormat`` its answer is written in; then the model's fields are checked,
                  image URLs fetched, a result-cache hit answered at once, each choice submitted, and
                  the events collected and formatted by gateway/render.py ``answer``.

Embeddings (gateway/embeddings.py) run their own steps inside ``handle``: each input is a request of
its own. A new generation API is a ``Codec``: ``parse`` and the format it returns, plus ``fields``,
its own names of the engine's request fields, so an error about one names it as the client sent it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import msgspec
from fastapi import Request
from fastapi.responses import Response

from shmgate.gateway import tracing
from shmgate.gateway.choices import submit_choices
from shmgate.gateway.fetch import fetch_pending
from shmgate.gateway.fields import check_fields_for_model, with_image_options
from shmgate.gateway.frontend import Frontend
from shmgate.gateway.http_errors import count_error, error_response
from shmgate.gateway.intake import ChatRequest, IntakeLimits, key_material
from shmgate.gateway.render import AnswerFormat, KeepAnswer, answer, cached_answer
from shmgate.gateway.result_cache import ResultCache, answer_key, keyed_off_the_loop
from shmgate.gateway.served import Served, bypass_cache, read_body, served
from shmgate.gateway.tool_answer import with_tools  # tools
from shmgate.shared.errors import InvalidRequest, RequestError, ShmgateError
from shmgate.shared.stages import Stage
from shmgate.shared.wire import Finished

__all__ = ["Arrival", "Codec", "generate", "handle"]


@dataclass(frozen=True)
class Arrival:
    """A request whose key was checked and whose body was read: what an endpoint's steps start from."""

    served: Served
    request: Request
    body: bytes
    started: float  # time.monotonic() when the route began
    read_s: float  # the body's read


async def handle(request: Request, steps: Callable[[Arrival], Awaitable[Response]]) -> Response:
    """Check the key, read the body, run the endpoint's ``steps``; a ShmgateError is the client's error.

    A request ``steps`` answers is counted by the answer (gateway/render.py, or the endpoint); one that
    ends in an error is counted here, once.
    """
    s = served(request)
    started = time.monotonic()
    try:
        s.check_key(request)
        body = await read_body(request, s.options.max_body_bytes)
        read_s = time.monotonic() - started
        s.frontend.stages.observe(Stage.BODY_READ, read_s)
        if tracing.spans is not None:
            tracing.spans.stage("body_read", started, read_s, **{"http.request.body.size": len(body)})
        return await steps(Arrival(s, request, body, started, read_s))
    except ShmgateError as exc:
        count_error(s.frontend.stats, exc)
        return error_response(exc)


class Codec(Protocol):
    """A generation API: its request parser and the format of its answers."""

    # the engine request's field names (the chat form's, as gateway/fields.py names them) in this API
    fields: Mapping[str, str]

    def parse(self, body: bytes, limits: IntakeLimits) -> tuple[ChatRequest, AnswerFormat]:
        """The engine's request and the answer's format; raises RequestError subclasses naming this API's fields."""
        ...


async def generate(arrival: Arrival, codec: Codec) -> Response:
    """A generation request's steps after its body: parse, check, fetch, the result cache, submit, answer."""
    s = arrival.served
    f, options, results = s.frontend, s.options, s.results
    chat, fmt = codec.parse(arrival.body, options.intake)
    pre = f.preprocessor_for(chat.model)  # the model the request names (404 for one not served)
    try:
        check_fields_for_model(chat.params, pre, chat.n)
        chat = with_image_options(chat, pre)
    except RequestError as exc:
        exc.param = codec.fields.get(exc.param or "", exc.param)
        raise
    if not pre.serves_chat:
        raise InvalidRequest(f"{pre.model} is an embedding model; use POST /v1/embeddings", param="model")
    chat, fmt = with_tools(chat, fmt, pre)  # tools: the prompt's tool format, the calls' grammar and reader
    if chat.pending_urls:
        if tracing.spans is None:
            chat = await fetch_pending(chat, options.image_urls)
        else:
            with tracing.spans.live("image_url_fetch", **{"shmgate.image_urls": len(chat.pending_urls)}):
                chat = await fetch_pending(chat, options.image_urls)
    keep: KeepAnswer | None = None
    if results is not None:
        key = await keyed_off_the_loop(
            sum(len(key_material(i)) for i in chat.images), functools.partial(answer_key, chat, pre)
        )
        if key is not None:
            cached = None if bypass_cache(arrival.request) else results.get(key)
            f.stats.set_result_cache(results.stats, results.used_bytes)
            if cached is not None:
                read_s = arrival.read_s if options.server_timing else None
                return cached_answer(f, fmt, chat.stream, cached, arrival.started, read_s=read_s)
            keep = functools.partial(_keep_answer, f, results, key)
    states = await submit_choices(f, chat)
    for state in states:
        state.timing.spent[Stage.BODY_READ] = arrival.read_s
    return await answer(
        f,
        states,
        fmt,
        arrival.started,
        stream=chat.stream,
        logprobs=chat.params.logprobs >= 0,
        keep=keep,
        timing_header=options.server_timing,
        receive=arrival.request.receive,
    )


def _keep_answer(f: Frontend, results: ResultCache, key: bytes, event: Finished, text: str) -> None:
    """Store a completed deterministic answer in the result cache."""
    results.put(key, msgspec.msgpack.encode((text, event.finish_reason, event.prompt_tokens, event.completion_tokens)))
    f.stats.set_result_cache(results.stats, results.used_bytes)
