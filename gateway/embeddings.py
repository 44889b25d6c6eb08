"""``POST /v1/embeddings``: OpenAI's embeddings request, with images, over the chat path's data path.

Request forms (either works, so clients of OpenAI and of vLLM both do):
- ``input``: a string or a list of strings. A data URL (or an http(s) URL with
  ``--allow-image-urls``) is an image; any other string is text, embedded by models with a
  text tower (CLIP, SigLIP, SigLIP2) and a 400 naming ``input`` for image-only models.
- ``messages``: chat messages (vLLM's form); their one image part, or their text, is the input.
  An image and text together are refused: these models embed one or the other.

Each input travels as its own request (``Submit.task == TASK_EMBED``) through the same steps as a
chat image: admission, the content cache (a repeated image is not decoded again), the arena, the
workers' batching, and its vector comes back in ``Vector`` pieces (worker/vectors.py). So inputs of
one request and of concurrent requests batch together in the workers, and batched equals solo.
With a result cache (gateway/result_cache.py) a repeated input skips the worker as well.
A client that hangs up while its inputs are computed cancels them, as a chat client does
(``cancel_on_hang_up``, gateway/render.py): no worker computes for nobody to the end, the
arena holds go back when the workers end, and the request is counted ``cancelled``, not ``ok``.

Limits are the chat path's: at most ``--max-images`` images, ``max_parts`` inputs, the body, bytes
and pixel bounds; errors are the same OpenAI error objects. Vectors are unit-normalised float32;
``encoding_format: base64`` sends their little-endian float32 bytes. ``dimensions`` is accepted
only when it equals the model's size: none of these models is trained to be truncated.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np
from starlette.types import Receive

from shmgate.gateway.fetch import fetch_pending
from shmgate.gateway.frontend import Frontend, RequestState
from shmgate.gateway.http_errors import count_ok, failure_error
from shmgate.gateway.intake import (
    ChatCompletionRequest,
    EncodedImage,
    GenerationRequest,
    IntakeLimits,
    Message,
    add_image,
    chat_request_from,
    decode_body,
    key_material,
)
from shmgate.gateway.pipeline import Arrival
from shmgate.gateway.preprocess.base import Preprocessor
from shmgate.gateway.render import HungUp, Whole, cancel_on_hang_up
from shmgate.gateway.request_context import INTERACTIVE_REQUEST, RequestContext
from shmgate.gateway.result_cache import ResultCache, keyed_off_the_loop, result_key
from shmgate.gateway.served import Served
from shmgate.shared.errors import Cancelled, InvalidRequest, ShmgateError, TooManyImages
from shmgate.shared.wire import TASK_EMBED, Failed, Finished, Vector

__all__ = ["EmbeddingJob", "EmbeddingRequest", "embed", "embed_steps", "embedding_body", "parse_embedding_request"]


class EmbeddingRequest(msgspec.Struct):
    model: str
    input: str | list[str] | None = None
    messages: list[Message] | None = None
    encoding_format: Literal["float", "base64"] | None = None  # null: "float"
    dimensions: int | None = None
    user: str | None = None


_decoder = msgspec.json.Decoder(EmbeddingRequest)


@dataclass
class EmbeddingJob:
    """A parsed request. ``chat`` holds the images (and pending URLs, for gateway.fetch); each input
    is ``(image index, "")`` or ``(None, text)``, with the request field it came from."""

    model: str
    chat: GenerationRequest
    inputs: list[tuple[int | None, str, str]]  # (image index or None, text, param)
    encoding_format: str


def parse_embedding_request(
    body: bytes, limits: IntakeLimits, preprocessor_for: Callable[[str], Preprocessor]
) -> EmbeddingJob:
    """Parse and validate; raises RequestError subclasses naming the offending param.

    ``preprocessor_for``: the served model's preprocessor by id, raising UnknownModel for another.
    """
    req: EmbeddingRequest = decode_body(_decoder, body)
    preprocessor = preprocessor_for(req.model)
    dim = preprocessor.embedding_dim
    if dim is None:
        raise InvalidRequest(f"{preprocessor.model} does not produce embeddings", param="model")
    if req.dimensions is not None and req.dimensions != dim:
        raise InvalidRequest(
            f"{preprocessor.model} embeds into {dim} dimensions only; leave dimensions out", param="dimensions"
        )
    if (req.input is None) == (req.messages is None):
        raise InvalidRequest("send either input or messages", param="input")
    if req.messages is not None:
        chat = chat_request_from(ChatCompletionRequest(req.model, req.messages), limits)
        if len(chat.images) > 1:
            raise TooManyImages(
                "the messages form embeds one image per request; use input for several", param="messages"
            )
        if chat.images and chat.text.strip():
            raise InvalidRequest("these models embed an image or a text, not both in one input", param="messages")
        inputs: list[tuple[int | None, str, str]] = (
            [(0, "", chat.image_params[0])] if chat.images else [(None, chat.text, "messages")]
        )
    else:
        chat = GenerationRequest(req.model)  # the images of input's data URLs (and URLs to fetch) only
        inputs = _inputs(req.input, limits, chat)
    for index, text, param in inputs:
        if index is None and not text.strip():
            raise InvalidRequest("an input is empty", param=param)
        if index is None and not preprocessor.embeds_text:
            raise InvalidRequest(
                f"{preprocessor.model} embeds images only; send each image as a data URL (data:image/jpeg;base64,...)",
                param=param,
            )
    return EmbeddingJob(req.model, chat, inputs, req.encoding_format or "float")


def _inputs(
    raw: str | list[str] | None, limits: IntakeLimits, chat: GenerationRequest
) -> list[tuple[int | None, str, str]]:
    strings = [raw] if isinstance(raw, str) else list(raw or [])
    if not strings:
        raise InvalidRequest("input must not be empty", param="input")
    if len(strings) > limits.max_parts:
        raise InvalidRequest(f"at most {limits.max_parts} inputs are accepted", param="input")
    inputs: list[tuple[int | None, str, str]] = []
    for i, s in enumerate(strings):
        param = "input" if isinstance(raw, str) else f"input[{i}]"
        head = s[:8].lower()
        if not head.startswith(("data:", "http://", "https://")):
            inputs.append((None, s, param))
            continue
        if len(chat.images) >= limits.max_images:
            raise TooManyImages(f"at most {limits.max_images} images per request", param="input")
        add_image(s, param, limits, chat.images, chat.image_params, chat.pending_urls)
        inputs.append((len(chat.images) - 1, "", param))
    if sum(len(text) for _, text, _ in inputs) > limits.max_text_chars:
        raise InvalidRequest(f"the text is longer than {limits.max_text_chars} characters", param="input")
    return inputs


async def embed(
    f: Frontend,
    job: EmbeddingJob,
    cache: ResultCache | None,
    *,
    bypass_cache: bool = False,
    receive: Receive | None = None,
    context: RequestContext = INTERACTIVE_REQUEST,
) -> tuple[list[bytes], int]:
    """Every input's vector (float32 bytes, in input order) and the prompt tokens used. Raises ShmgateError.

    Two passes: every input is first answered from the result cache or submitted (concurrently),
    then the submitted ones are collected while ``cancel_on_hang_up`` watches the connection, as
    the chat route does. Submitting first means the watcher knows every request it may have to
    cancel; a client that hung up while its images were decoded is seen at once, because the
    server's next ASGI message is already its ``http.disconnect``. A hang-up abandons every input
    not done (each counted ``cancelled``, as each choice of a chat's n is) and raises Cancelled.

    On the first failure the others still finish (their holds are released as usual) and that
    failure is raised; a hang-up's Cancelled goes first, since nobody is left to read another.
    """
    params = f.preprocessor_for(job.model).cache_params()
    submitted: list[RequestState] = []
    admitted: list[bool] = []  # the request's first submission is counted admitted, once
    try:
        started = await asyncio.gather(
            *(
                _start(f, job, index, text, param, cache, bypass_cache, params, submitted, admitted, context)
                for index, text, param in job.inputs
            ),
            return_exceptions=True,
        )
        watcher = cancel_on_hang_up(f, submitted, receive if submitted else None)
        try:
            results = await asyncio.gather(*(_finish(f, one, cache) for one in started), return_exceptions=True)
        finally:
            if watcher is not None:
                watcher.cancel()
    finally:
        for state in submitted:  # only when interrupted (the route's task cancelled) is one not done here
            if not state.done:
                f.abandon(state)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        raise next((e for e in failures if isinstance(e, Cancelled)), failures[0])
    done = [r for r in results if not isinstance(r, BaseException)]
    return [vector for vector, _ in done], sum(tokens for _, tokens in done)


@dataclass
class _Started:
    """One input after the first pass: its vector (a result-cache hit) or its submitted request."""

    vector: bytes | None = None
    state: RequestState | None = None
    key: bytes | None = None  # where its vector goes in the result cache


async def _start(
    f: Frontend,
    job: EmbeddingJob,
    index: int | None,
    text: str,
    param: str,
    cache: ResultCache | None,
    bypass_cache: bool,
    params: bytes,
    submitted: list[RequestState],
    admitted: list[bool],
    context: RequestContext,
) -> _Started:
    image: bytes | EncodedImage | None = None if index is None else job.chat.images[index]
    key = None
    if cache is not None:
        material = text if image is None else key_material(image)
        kind = "text" if image is None else "image"
        key = await keyed_off_the_loop(len(material), lambda: result_key(material, job.model, params, kind))
        hit = None if bypass_cache else cache.get(key)
        if hit is not None:
            return _Started(vector=hit)
    messages = [
        {"role": "user", "content": [{"type": "image"} if image is not None else {"type": "text", "text": text}]}
    ]
    chat = GenerationRequest(
        job.model,
        messages,
        images=[] if image is None else [image],
        image_params=[] if image is None else [param],
        text=text,
        task=TASK_EMBED,
        image_options=[] if image is None else [f.preprocessor.embedding_image_options()],
    )
    first = not admitted
    admitted.append(True)  # no await since the check: a concurrent input sees it
    state = await f.submit(chat, first=first, context=context)
    submitted.append(state)
    return _Started(state=state, key=key)


async def _finish(f: Frontend, started: _Started | BaseException, cache: ResultCache | None) -> tuple[bytes, int]:
    """The input's vector and prompt tokens; raises what its first pass raised, or its failure."""
    if isinstance(started, BaseException):
        raise started
    if started.state is None:
        assert started.vector is not None  # a result-cache hit
        return started.vector, 0
    state = started.state
    vector = bytearray()
    tokens = 0
    try:
        async for event in f.events(state):
            if isinstance(event, Vector):
                if event.offset != len(vector):
                    raise ShmgateError("an embedding arrived out of order")
                vector += event.data
            elif isinstance(event, Failed):
                raise failure_error(event)
            elif isinstance(event, Finished):
                tokens = event.prompt_tokens
                f.stages.delivered(state.timing)
    finally:
        if not state.done:
            f.abandon(state)
    if not vector or len(vector) % 4:
        raise ShmgateError("the model returned no embedding")
    if cache is not None and started.key is not None:
        cache.put(started.key, bytes(vector))
    return bytes(vector), tokens


def embedding_body(job: EmbeddingJob, vectors: list[bytes], tokens: int) -> dict[str, object]:
    """The OpenAI response body."""
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(v).decode()
            if job.encoding_format == "base64"
            else np.frombuffer(v, dtype="<f4").tolist(),
        }
        for i, v in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": job.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def embed_steps(s: Served, arrival: Arrival) -> Whole:
    """``POST /v1/embeddings``'s steps after its body (its row in gateway/endpoints.py): parse, fetch image
    URLs, embed every input; its vectors, or the client's error raised. A hang-up while the inputs run
    raises ``HungUp`` (see ``embed``)."""
    f, options, results = s.frontend, s.options, s.results
    job = parse_embedding_request(arrival.body, options.intake, f.preprocessor_for)
    if job.chat.pending_urls:
        job = dataclasses.replace(job, chat=await fetch_pending(job.chat, options.image_urls))
    try:
        vectors, tokens = await embed(
            f, job, results, bypass_cache=arrival.bypass_cache, receive=arrival.receive, context=arrival.context
        )
    except Cancelled:  # the client hung up while its inputs ran: counted by abandon, answered to nobody
        raise HungUp() from None
    finally:
        if results is not None:
            f.stats.set_result_cache(results.stats, results.used_bytes)
    count_ok(f.stats, time.monotonic() - arrival.started)
    return Whole(embedding_body(job, vectors, tokens))
