"""A chat request's ``n`` choices, each submitted as its own request (gateway/render.py answers them).

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

import dataclasses

import msgspec

from shmgate.gateway.frontend import Frontend, RequestState
from shmgate.gateway.intake import GenerationRequest
from shmgate.gateway.request_context import INTERACTIVE_REQUEST, RequestContext

__all__ = ["choice_requests", "submit_choices"]


def choice_requests(chat: GenerationRequest) -> list[GenerationRequest]:
    """The n single-choice requests of ``chat``: choice i samples with ``seed + i`` when a seed is given."""
    if chat.n == 1:
        return [chat]
    seed = chat.params.seed
    return [
        dataclasses.replace(
            chat,
            n=1,
            params=chat.params
            if seed is None
            else msgspec.structs.replace(chat.params, seed=(seed + i + (1 << 63)) % (1 << 64) - (1 << 63)),
        )
        for i in range(chat.n)
    ]


async def submit_choices(
    f: Frontend, chat: GenerationRequest, context: RequestContext = INTERACTIVE_REQUEST
) -> list[RequestState]:
    """Submit every choice; raises ShmgateError on submit, having abandoned the choices already submitted."""
    states: list[RequestState] = []
    try:
        for one in choice_requests(chat):
            states.append(await f.submit(one, first=not states, context=context))
    except BaseException:
        for state in states:
            f.abandon(state)
        raise
    return states
