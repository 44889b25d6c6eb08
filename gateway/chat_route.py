"""``POST /v1/chat/completions``: from the body to submitted choices; gateway/render.py answers them.

The steps, each of which may end the request with an OpenAI error object: the key, the body
(bounded), parsing and the model's fields, image URLs fetched, a result-cache hit answered at once,
then one request per choice (gateway/choices.py) submitted to the workers.
"""

from __future__ import annotations

import functools
import time

import msgspec
from fastapi import Request
from fastapi.responses import Response

from shmgate.gateway import tracing
from shmgate.gateway.choices import submit_choices
from shmgate.gateway.fetch import fetch_pending
from shmgate.gateway.fields import check_fields_for_model, with_image_options
from shmgate.gateway.frontend import Frontend
from shmgate.gateway.http_errors import count_error, error_response
from shmgate.gateway.intake import key_material, parse_chat_request
from shmgate.gateway.render import KeepAnswer, answer, cached_answer
from shmgate.gateway.result_cache import ResultCache, answer_key, keyed_off_the_loop
from shmgate.gateway.served import bypass_cache, read_body, served
from shmgate.shared.errors import InvalidRequest, ShmgateError
from shmgate.shared.stages import Stage
from shmgate.shared.wire import Finished

__all__ = ["chat_completions"]


async def chat_completions(request: Request) -> Response:
    s = served(request)
    f, options, results = s.frontend, s.options, s.results
    started = time.monotonic()
    keep: KeepAnswer | None = None
    try:
        s.check_key(request)
        body = await read_body(request, options.max_body_bytes)
        read_s = time.monotonic() - started
        f.stages.observe(Stage.BODY_READ, read_s)
        if tracing.spans is not None:
            tracing.spans.stage("body_read", started, read_s, **{"http.request.body.size": len(body)})
        chat = parse_chat_request(body, options.intake)
        pre = f.preprocessor_for(chat.model)  # the model the request names (404 for one not served)
        check_fields_for_model(chat.params, pre, chat.n)
        chat = with_image_options(chat, pre)
        if not pre.serves_chat:
            raise InvalidRequest(f"{pre.model} is an embedding model; use POST /v1/embeddings", param="model")
        if chat.pending_urls:
            if tracing.spans is None:
                chat = await fetch_pending(chat, options.image_urls)
            else:
                with tracing.spans.live("image_url_fetch", **{"shmgate.image_urls": len(chat.pending_urls)}):
                    chat = await fetch_pending(chat, options.image_urls)
        key = None
        if results is not None:
            key = await keyed_off_the_loop(
                sum(len(key_material(i)) for i in chat.images), functools.partial(answer_key, chat, pre)
            )
        if results is not None and key is not None:
            cached = None if bypass_cache(request) else results.get(key)
            f.stats.set_result_cache(results.stats, results.used_bytes)
            if cached is not None:
                return cached_answer(f, chat.model, chat.stream, chat.include_usage, cached, started)
            keep = functools.partial(_keep_answer, f, results, key)
        states = await submit_choices(f, chat)
    except ShmgateError as exc:
        count_error(f.stats, exc)
        return error_response(exc)
    for state in states:
        state.timing.spent[Stage.BODY_READ] = read_s
    return await answer(
        f,
        states,
        chat.model,
        started,
        stream=chat.stream,
        include_usage=chat.include_usage,
        logprobs=chat.params.logprobs >= 0,
        keep=keep,
        timing_header=options.server_timing,
        receive=request.receive,
    )


def _keep_answer(f: Frontend, results: ResultCache, key: bytes, event: Finished, text: str) -> None:
    """Store a completed deterministic answer in the result cache."""
    results.put(key, msgspec.msgpack.encode((text, event.finish_reason, event.prompt_tokens, event.completion_tokens)))
    f.stats.set_result_cache(results.stats, results.used_bytes)
