"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes): clients size requests before sending them.

``/tokenize`` takes a chat body (``model``, ``messages`` with images; or ``prompt``, plain text) and
answers ``{"count", "max_model_len", "tokens"}``: the token ids exactly as the model would read them,
chat template applied and each image's placeholder expanded to its image tokens. Counting image
tokens needs each image's size after the processor, so the images are decoded and processed here,
in a thread, into private numpy buffers: nothing is written to the arena and nothing reaches a
worker. No length check: a prompt too long for the model is still counted (that is the point).

Only ``hf:`` chat models tokenize; classifiers and embedding models answer 400 naming ``model``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from shmgate.gateway.decode_budget import DecodeBudget
from shmgate.gateway.fetch import FetchPolicy, fetch_pending
from shmgate.gateway.fields import with_image_options
from shmgate.gateway.intake import (
    ChatCompletionRequest,
    GenerationRequest,
    IntakeLimits,
    Message,
    chat_request_from,
    decode_body,
    image_bytes,
)
from shmgate.gateway.preprocess.base import Preprocessor
from shmgate.shared.errors import InvalidRequest, ShmgateError

__all__ = ["detokenize", "model_card", "tokenize"]


class TokenizeRequest(msgspec.Struct):
    model: str
    messages: list[Message] | None = None
    prompt: str | None = None
    add_generation_prompt: bool = True  # accepted for vLLM compatibility; the chat path always adds it
    mm_processor_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct):
    model: str
    tokens: list[int]


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)
MAX_DETOKENIZE = 1 << 20


def model_card(preprocessor: Preprocessor, created: int) -> dict[str, Any]:
    """The model's entry in ``GET /v1/models``; ``created``: when the node started serving it (Unix seconds);
    ``max_model_len`` (prompt + answer tokens) where the model has a context bound (``hf:`` chat models: the
    text config's ``max_position_embeddings``)."""
    card: dict[str, Any] = {"id": preprocessor.model, "object": "model", "created": created, "owned_by": "shmgate"}
    max_len = preprocessor.max_prompt_tokens
    if max_len is not None:
        card["max_model_len"] = max_len
    return card


def _tokenizing(preprocessor_for: Callable[[str], Preprocessor], model: str) -> Preprocessor:
    """The named model's preprocessor, if it tokenizes (``preprocessor_for`` raises UnknownModel for another)."""
    preprocessor = preprocessor_for(model)
    if not preprocessor.tokenizes or not preprocessor.serves_chat:
        raise InvalidRequest(f"{preprocessor.model} has no tokenizer to count with", param="model")
    return preprocessor


async def tokenize(
    preprocessor_for: Callable[[str], Preprocessor],
    body: bytes,
    limits: IntakeLimits,
    policy: FetchPolicy,
    max_pixels: int,
    decode_budget: DecodeBudget,
) -> dict[str, Any]:
    """The ``/tokenize`` answer for ``body``. Raises ShmgateError subclasses (400s naming the field).

    Its images are decoded (their token counts follow their sizes) within the frontend's decode
    memory budget, as the chat path's are: counting tokens is no way around ``--decode-memory-mb``.
    """
    req = decode_body(_tokenize_decoder, body)
    pre = _tokenizing(preprocessor_for, req.model)
    if (req.messages is None) == (req.prompt is None):
        raise InvalidRequest("send either messages or prompt", param="messages")
    if req.prompt is not None:
        if len(req.prompt) > limits.max_text_chars:
            raise InvalidRequest(f"the prompt is longer than {limits.max_text_chars} characters", param="prompt")
        tokens = await asyncio.to_thread(pre.text_token_ids, req.prompt)
    else:
        chat = chat_request_from(
            ChatCompletionRequest(model=req.model, messages=req.messages, mm_processor_kwargs=req.mm_processor_kwargs),
            limits,
        )
        chat = with_image_options(chat, pre)
        if chat.pending_urls:
            chat = await fetch_pending(chat, policy)
        tokens = await asyncio.to_thread(_chat_tokens, pre, chat, max_pixels, decode_budget)
    return {"count": len(tokens), "max_model_len": pre.max_prompt_tokens, "tokens": tokens}


def _chat_tokens(pre: Preprocessor, chat: GenerationRequest, max_pixels: int, decode_budget: DecodeBudget) -> list[int]:
    specs = []
    for i, (image, param) in enumerate(zip(chat.images, chat.image_params)):
        spec: dict[str, tuple[str, tuple[int, ...]]] = {}

        def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
            spec[name] = (dtype, shape)
            return np.empty(shape, dtype=dtype)

        try:
            decode_budget.preprocess(
                pre, image_bytes(image), allocate, max_pixels=max_pixels, options=chat.image_options[i]
            )
        except ShmgateError as exc:
            exc.param = exc.param or param
            raise
        specs.append(spec)
    return pre.prompt_token_ids(chat.messages, specs)


async def detokenize(preprocessor_for: Callable[[str], Preprocessor], body: bytes) -> dict[str, Any]:
    """The ``/detokenize`` answer: ``{"prompt": text}``. Raises ShmgateError subclasses."""
    req = decode_body(_detokenize_decoder, body)
    pre = _tokenizing(preprocessor_for, req.model)
    if len(req.tokens) > MAX_DETOKENIZE:
        raise InvalidRequest(f"at most {MAX_DETOKENIZE} tokens", param="tokens")
    return {"prompt": await asyncio.to_thread(pre.detokenize, req.tokens)}
