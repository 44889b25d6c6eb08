"""OpenAI response shapes: chat.completion, chat.completion.chunk, and their SSE framing.

Streaming follows what the OpenAI client expects: the first chunk's delta
carries the role, ``finish_reason`` rides on the last content chunk's
successor, with ``stream_options.include_usage`` a chunk with empty
``choices`` and the usage comes just before ``data: [DONE]``, and a failure
after the stream started is an event with an ``error`` object.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from shmgate.shared.wire import TokenLogprob

__all__ = ["Completion", "logprob_entry", "usage"]

_json = msgspec.json.Encoder()


class Completion:
    """Builds the response objects of one request."""

    def __init__(self, model: str) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model = model

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return b"data: " + _json.encode(body) + b"\n\n"

    def role_chunk(self, *, index: int = 0) -> bytes:
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])

    def content_chunk(self, text: str, logprobs: list[dict[str, Any]] | None = None, *, index: int = 0) -> bytes:
        choice: dict[str, Any] = {"index": index, "delta": {"content": text}, "finish_reason": None}
        if logprobs is not None:
            choice["logprobs"] = {"content": logprobs}
        return self._chunk([choice])

    def finish_chunk(self, finish_reason: str, *, index: int = 0) -> bytes:
        return self._chunk([{"index": index, "delta": {}, "finish_reason": finish_reason}])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self._chunk([], usage=usage(prompt_tokens, completion_tokens))

    @staticmethod
    def error_event(error: dict[str, Any]) -> bytes:
        return b"data: " + _json.encode(error) + b"\n\n"

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"

    def completion(
        self,
        text: str,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        return self.completion_of([self.choice(0, text, finish_reason, logprobs)], prompt_tokens, completion_tokens)

    def completion_of(
        self, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        """The ``chat.completion`` body with these ``choices`` (each from ``choice``)."""
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    @staticmethod
    def choice(
        index: int, text: str, finish_reason: str, logprobs: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """One whole answer of a ``chat.completion``; ``logprobs`` only when the request asked for them."""
        choice: dict[str, Any] = {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
        }
        if logprobs is not None:
            choice["logprobs"] = {"content": logprobs}
        return choice


def logprob_entry(entry: TokenLogprob) -> dict[str, Any]:
    """OpenAI's ``logprobs.content[i]`` for one sampled token (``bytes``: its text's UTF-8 bytes)."""
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.token.encode()),
        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in entry.top],
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
