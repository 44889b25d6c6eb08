"""OpenAI chat response shapes: chat.completion, chat.completion.chunk, their SSE framing, and ``ChatFormat``.

Streaming follows what the OpenAI client expects: the first chunk's delta
carries the role, ``finish_reason`` rides on the last content chunk's
successor, with ``stream_options.include_usage`` a chunk with empty
``choices`` and the usage comes just before ``data: [DONE]``, and a failure
after the stream started is an event with an ``error`` object.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec

from shmgate.gateway.http_errors import error_body
from shmgate.shared.errors import ShmgateError
from shmgate.shared.wire import TokenLogprob

if TYPE_CHECKING:
    from shmgate.gateway.render import Outcome
    from shmgate.gateway.tool_output import ToolCall

__all__ = ["ChatFormat", "Completion", "logprob_entry", "usage"]

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

    def tool_call_chunk(self, call: dict[str, Any], *, index: int = 0) -> bytes:
        """A delta of one tool call: its opening (index, id, type, name, empty arguments) or arguments."""
        return self._chunk([{"index": index, "delta": {"tool_calls": [call]}, "finish_reason": None}])

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
        index: int,
        text: str,
        finish_reason: str,
        logprobs: list[dict[str, Any]] | None = None,
        tool_calls: list[ToolCall] | None = None,
    ) -> dict[str, Any]:
        """One whole answer of a ``chat.completion``; ``logprobs`` only when the request asked for them;
        ``tool_calls`` when it made calls (its content is then null unless it wrote text too)."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["content"] = text or None
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in tool_calls
            ]
        choice: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish_reason}
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


class ChatFormat:
    """The Chat Completions wire format of a generated answer (gateway/render.py ``AnswerFormat``).

    ``include_usage``: a stream ends with the usage chunk (``stream_options.include_usage``). A whole
    answer carries each choice's logprobs when the outcome has them (the request asked for them).
    """

    def __init__(self, model: str, *, include_usage: bool = False) -> None:
        self.completion = Completion(model)
        self.include_usage = include_usage

    def opening(self, n: int) -> bytes:
        return b"".join(self.completion.role_chunk(index=i) for i in range(n))

    def delta(self, index: int, text: str, logprobs: list[dict[str, Any]] | None) -> bytes:
        return self.completion.content_chunk(text, logprobs, index=index)

    def finished(self, index: int, reason: str, logprobs: list[dict[str, Any]] | None) -> bytes:
        # entries left are of tokens with no text of their own (EOS, a held-back stop): their own chunk
        head = self.completion.content_chunk("", logprobs, index=index) if logprobs else b""
        return head + self.completion.finish_chunk(reason, index=index)

    def expect_calls(self) -> None:
        """The answer may hold calls: nothing changes in the chat format's events."""

    def call_opened(self, index: int, call: ToolCall) -> bytes:
        opened = {
            "index": call.index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        return self.completion.tool_call_chunk(opened, index=index)

    def call_arguments(self, index: int, call: ToolCall, fragment: str) -> bytes:
        return self.completion.tool_call_chunk({"index": call.index, "function": {"arguments": fragment}}, index=index)

    def failed(self, error: ShmgateError) -> bytes:
        return self.completion.error_event(error_body(error.message, error.error_type, error.code))

    def closing(self, outcome: Outcome) -> bytes:
        usage_chunk = b""
        if self.include_usage:
            usage_chunk = self.completion.usage_chunk(outcome.prompt_tokens, outcome.completion_tokens)
        return usage_chunk + self.completion.done()

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        entries, calls = outcome.logprobs, outcome.tool_calls
        choices = [
            self.completion.choice(
                i,
                text,
                outcome.finish_reasons[i],
                None if entries is None else entries[i],
                None if calls is None else calls[i],
            )
            for i, text in enumerate(outcome.texts)
        ]
        return self.completion.completion_of(choices, outcome.prompt_tokens, outcome.completion_tokens)
