"""``n > 1``: several answers to one chat request, as OpenAI's ``choices[0..n-1]``.

Why a fan-out in the frontend rather than n rows in the worker: each choice is an ordinary request
(its own seeded generator, its own row in a batch), so the worker's invariant "an answer depends
only on its own request" gives every choice exactly the answer it would get alone, and the images
are resolved once and then hit the content cache. With a ``seed``, choice i samples with
``seed + i`` (reproducible, and different choices); without one, each draws its own entropy.
Greedy choices (temperature 0) are all equal, as with any server.

A failure of any choice fails the whole request (the others are cancelled): a partial set of
choices is not an answer OpenAI's clients expect.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse

from gateway.frontend import Frontend, RequestState
from gateway.http_errors import count_error, error_body, error_response
from gateway.http_errors import failure_error as _failure
from gateway.intake import ChatRequest
from gateway.metrics import Counter
from gateway.sse import Completion, logprob_entry, usage
from shared.wire import Delta, Failed, Finished, TokenLogprobs, Vector

__all__ = ["answer_choices"]



def choice_requests(chat: ChatRequest) -> list[ChatRequest]:
    """The n single-choice requests of ``chat``: choice i samples with ``seed + i`` when a seed is given."""
    seed = chat.params.seed
    return [dataclasses.replace(chat, n=1, params=chat.params if seed is None else msgspec.structs.replace(
        chat.params, seed=(seed + i + (1 << 63)) % (1 << 64) - (1 << 63))) for i in range(chat.n)]


async def answer_choices(f: Frontend, chat: ChatRequest, started: float) -> Response:
    """Submit every choice, then answer them together (streamed or whole). Raises ShmgateError on submit.

    A Failed choice counts as the request's error (http_errors.count_error).
    """
    states: list[RequestState] = []
    try:
        for one in choice_requests(chat):
            states.append(await f.submit(one))
    except BaseException:
        for state in states:
            f.abandon(state)
        raise
    logprobs = chat.params.logprobs >= 0
    if chat.stream:
        return _stream(f, states, chat.model, chat.include_usage, started, logprobs)
    return await _complete(f, states, chat.model, started, logprobs)


async def _merged(f: Frontend, states: list[RequestState]) -> AsyncIterator[
        tuple[int, Delta | Vector | TokenLogprobs | Finished | Failed]]:
    """Every choice's events as (choice index, event), in arrival order."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, state: RequestState) -> None:
        async for event in f.events(state):
            queue.put_nowait((index, event))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(states)]
    try:
        ended = 0
        while ended < len(states):
            index, event = await queue.get()
            if isinstance(event, (Finished, Failed)):
                ended += 1
            yield index, event
    finally:
        for task in tasks:
            task.cancel()
        for state in states:
            if not state.done:
                f.abandon(state)


async def _complete(f: Frontend, states: list[RequestState], model: str, started: float,
                    logprobs: bool) -> Response:
    completion = Completion(model)
    texts: list[list[str]] = [[] for _ in states]
    entries: list[list[dict[str, Any]]] = [[] for _ in states]
    finished: dict[int, Finished] = {}
    async for index, event in _merged(f, states):
        if isinstance(event, TokenLogprobs):
            entries[index].append(logprob_entry(event.entry))
        elif isinstance(event, Delta):
            texts[index].append(event.text)
        elif isinstance(event, Failed):
            error = _failure(event)
            count_error(f.stats, error)
            return error_response(error)
        elif isinstance(event, Finished):
            finished[index] = event
    choices = []
    for i in range(len(states)):
        choice: dict[str, Any] = {"index": i, "message": {"role": "assistant", "content": "".join(texts[i])},
                                  "finish_reason": finished[i].finish_reason}
        if logprobs:
            choice["logprobs"] = {"content": entries[i]}
        choices.append(choice)
    body = completion.completion("", "stop", 0, 0)
    body["choices"] = choices
    body["usage"] = usage(finished[0].prompt_tokens, sum(e.completion_tokens for e in finished.values()))
    f.stats.add(Counter.REQUESTS_OK)
    f.stats.observe(Counter.LATENCY_BUCKETS, time.monotonic() - started)
    return JSONResponse(body)


def _stream(f: Frontend, states: list[RequestState], model: str, include_usage: bool, started: float,
            logprobs: bool) -> Response:
    completion = Completion(model)

    async def body() -> AsyncIterator[bytes]:
        pending: list[list[dict[str, Any]]] = [[] for _ in states]
        finished: dict[int, Finished] = {}
        for i in range(len(states)):
            yield completion.role_chunk(index=i)
        async for index, event in _merged(f, states):
            if isinstance(event, TokenLogprobs):
                pending[index].append(logprob_entry(event.entry))
            elif isinstance(event, Delta):
                yield completion.content_chunk(event.text, pending[index] if logprobs else None, index=index)
                pending[index] = []
            elif isinstance(event, Finished):
                if pending[index] and logprobs:
                    yield completion.content_chunk("", pending[index], index=index)
                finished[index] = event
                yield completion.finish_chunk(event.finish_reason, index=index)
            elif isinstance(event, Failed):
                error = _failure(event)
                count_error(f.stats, error)
                yield completion.error_event(error_body(error.message, error.error_type, error.code))
                return
        if include_usage:
            yield completion.usage_chunk(finished[0].prompt_tokens,
                                         sum(e.completion_tokens for e in finished.values()))
        yield completion.done()
        f.stats.add(Counter.REQUESTS_OK)
        f.stats.observe(Counter.LATENCY_BUCKETS, time.monotonic() - started)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

