"""One request pipeline for every endpoint: an endpoint is a codec (a parser and a formatter) over it.

The pipeline takes and returns data (DESIGN §4c): an ``Arrival`` (the body, when it arrived, whether
a cached answer may serve it, what to watch for a hang-up) in, an ``Answer`` (gateway/render.py: a
whole body, or a stream's events) out, a ShmgateError raised for the client's error. HTTP framing
lives at the edge (gateway/edge.py: the key, the body, the response, the error object and its
count); the batch runner (gateway/batch_runner.py) runs a line through the same steps in process.

    ``generate``  the steps of a generation (chat completions, responses): the codec parses the body
                  into the engine's request (a ``GenerationRequest``: the model, the prompt in the chat
                  template's form, the images, sampling and output constraints, n) and the
                  ``AnswerFormat`` its answer is written in; then the model's fields are checked,
                  image URLs fetched, a result-cache hit answered at once, each choice submitted, and
                  the events collected and formatted by gateway/render.py ``answer``.

Embeddings (gateway/embeddings.py) have steps of their own: each input is a request of its own. A
new generation API is a ``Codec``: ``parse`` and the format it returns, plus ``fields``, its own
names of the engine's request fields, so an error about one names it as the client sent it.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import msgspec
from starlette.types import Receive

from shmgate.gateway.choices import submit_choices
from shmgate.gateway.fetch import fetch_pending
from shmgate.gateway.fields import check_fields_for_model, with_image_options
from shmgate.gateway.frontend import Frontend
from shmgate.gateway.intake import GenerationRequest, IntakeLimits, key_material
from shmgate.gateway.render import Answer, AnswerFormat, KeepAnswer, answer, cached_answer
from shmgate.gateway.request_context import INTERACTIVE_REQUEST, RequestContext
from shmgate.gateway.result_cache import ResultCache, answer_key, keyed_off_the_loop
from shmgate.gateway.served import Served
from shmgate.gateway.tool_answer import with_tools  # tools
from shmgate.shared.errors import InvalidRequest, RequestError
from shmgate.shared.stages import Stage
from shmgate.shared.wire import Finished

__all__ = ["Arrival", "Codec", "Steps", "generate"]


@dataclass(frozen=True)
class Arrival:
    """A request's body and what the steps need of how it arrived: data, no HTTP object."""

    body: bytes
    started: float  # time.monotonic() when the request began
    read_s: float = 0.0  # the body's read (0: it arrived whole, a batch line)
    bypass_cache: bool = False  # ``Cache-Control: no-cache``: computed afresh (still stored)
    receive: Receive | None = None  # the connection, watched for a hang-up while nothing is written; None: none
    whole: bool = False  # the answer is wanted whole (a batch line): ``stream`` is refused
    context: RequestContext = INTERACTIVE_REQUEST  # its lane and tracing, handed down to the frontend


# An endpoint's steps after its body: the answer, or a ShmgateError raised (gateway/edge.py answers it).
Steps = Callable[[Served, Arrival], Awaitable[Answer]]


class Codec(Protocol):
    """A generation API: its request parser and the format of its answers."""

    # the engine request's field names (the chat form's, as gateway/fields.py names them) in this API
    fields: Mapping[str, str]

    def parse(self, body: bytes, limits: IntakeLimits) -> tuple[GenerationRequest, AnswerFormat]:
        """The engine's request and the answer's format; raises RequestError subclasses naming this API's fields."""
        ...


async def generate(s: Served, arrival: Arrival, codec: Codec) -> Answer:
    """A generation request's steps after its body: parse, check, fetch, the result cache, submit, answer.

    An error raised on the engine's request (a model's field check, a classifier given no image) names
    the chat form's field: it is renamed here as this API calls it.
    """
    try:
        return await _generate(s, arrival, codec)
    except RequestError as exc:
        _in_own_words(exc, codec.fields)
        raise


def _in_own_words(exc: RequestError, fields: Mapping[str, str]) -> None:
    """Name the field an error names as this API does, in ``param`` and in the message's field words
    (``response_format json_schema.name`` is ``text.format.name``). Idempotent."""
    if not fields:
        return
    head = (exc.param or "").partition("[")[0]
    if head in fields:
        exc.param = fields[head] + (exc.param or "")[len(head) :]
    for chat_word, own_word in fields.items():
        if "_" in chat_word:  # a field's name, not a word of prose ("messages")
            exc.message = exc.message.replace(f"{chat_word} json_schema.", f"{own_word}.")
            exc.message = exc.message.replace(chat_word, own_word)
    exc.args = (exc.message,)


async def _generate(s: Served, arrival: Arrival, codec: Codec) -> Answer:
    f, options, results = s.frontend, s.options, s.results
    chat, fmt = codec.parse(arrival.body, options.intake)
    if arrival.whole and chat.stream:
        raise InvalidRequest("a batch line is answered whole: leave stream out (or false)", param="stream")
    pre = f.preprocessor_for(chat.model)  # the model the request names (404 for one not served)
    check_fields_for_model(chat.params, pre, chat.n)
    chat = with_image_options(chat, pre)
    if not pre.serves_chat:
        raise InvalidRequest(f"{pre.model} is an embedding model; use POST /v1/embeddings", param="model")
    chat, fmt = with_tools(chat, fmt, pre)  # tools: the prompt's tool format, the calls' grammar and reader
    spans = arrival.context.spans
    if chat.pending_urls:
        if spans is None:
            chat = await fetch_pending(chat, options.image_urls)
        else:
            with spans.live("image_url_fetch", **{"shmgate.image_urls": len(chat.pending_urls)}):
                chat = await fetch_pending(chat, options.image_urls)
    keep: KeepAnswer | None = None
    if results is not None:
        key = await keyed_off_the_loop(
            sum(len(key_material(i)) for i in chat.images), functools.partial(answer_key, chat, pre)
        )
        if key is not None:
            cached = None if arrival.bypass_cache else results.get(key)
            f.stats.set_result_cache(results.stats, results.used_bytes)
            if cached is not None:
                read_s = arrival.read_s if options.server_timing else None
                return cached_answer(f, fmt, chat.stream, cached, arrival.started, read_s=read_s)
            keep = functools.partial(_keep_answer, f, results, key)
    states = await submit_choices(f, chat, arrival.context)
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
        receive=arrival.receive,
    )


def _keep_answer(f: Frontend, results: ResultCache, key: bytes, event: Finished, text: str) -> None:
    """Store a completed deterministic answer in the result cache."""
    results.put(key, msgspec.msgpack.encode((text, event.finish_reason, event.prompt_tokens, event.completion_tokens)))
    f.stats.set_result_cache(results.stats, results.used_bytes)
