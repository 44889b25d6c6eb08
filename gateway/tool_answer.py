"""Tool calling in the pipeline: the request's step (``with_tools``) and the answer's format (``ToolAnswer``).

``with_tools`` runs once the model is known: it refuses tools for a model that samples no tokens (a
400 naming the model), writes the conversation in the model's tool format (gateway/tool_prompt.py) and
sets the grammar that forces the calls (gateway/tools.py). ``ToolAnswer`` wraps the API's own format
(chat completions, responses): each choice's text is read into text and calls as it streams
(gateway/tool_output.py), the text goes out as text and the calls through the format's call events;
an answer that made calls and stopped finishes with ``tool_calls``. Usage counts every token, the
calls' included.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import msgspec

from shmgate.gateway.intake import GenerationRequest
from shmgate.gateway.preprocess.base import Preprocessor
from shmgate.gateway.render import AnswerFormat, Outcome
from shmgate.gateway.tool_output import CallArguments, CallOpened, Event, OutputReader, TextOut, ToolCall
from shmgate.gateway.tool_prompt import write_tools
from shmgate.gateway.tools import history_has_tools, tool_grammar
from shmgate.shared.errors import InvalidRequest, ShmgateError
from shmgate.shared.families.tool_formats import ToolFormat

__all__ = ["ToolAnswer", "ToolCallFormat", "with_tools"]


class ToolCallFormat(AnswerFormat, Protocol):
    """An API format that can write tool calls (gateway/sse.py ``ChatFormat``, gateway/responses_format.py)."""

    def expect_calls(self) -> None:
        """The answer may hold calls (before ``opening``)."""
        ...

    def call_opened(self, index: int, call: ToolCall) -> bytes: ...

    def call_arguments(self, index: int, call: ToolCall, fragment: str) -> bytes: ...


def with_tools(chat: GenerationRequest, fmt: AnswerFormat, pre: Preprocessor) -> tuple[GenerationRequest, AnswerFormat]:
    """``chat`` with its tools written into the prompt and its grammar set, and ``fmt`` reading calls.

    A request with neither tools nor calls or results in its conversation is returned as it is.
    Raises InvalidRequest: a model that cannot call tools (param ``tools``), tools with
    ``response_format`` (the answer is calls or free text, not one JSON document), a grammar refused.
    """
    if chat.tools is None and not history_has_tools(chat.messages):
        return chat, fmt
    prompt = pre.tool_prompt()
    if prompt is None:
        raise InvalidRequest(
            f"tools are not supported by {pre.model}: it does not generate text",
            param="tools" if chat.tools is not None else "messages",  # calls or results in the conversation
        )
    messages, template_args = write_tools(chat.messages, chat.tools, prompt)
    chat = dataclasses.replace(chat, messages=messages, template_args=template_args)
    if chat.tools is None:
        return chat, fmt
    if chat.params.grammar:
        raise InvalidRequest(
            "response_format cannot be combined with tools: the answer is free text or calls", param="response_format"
        )
    grammar = tool_grammar(chat.tools, prompt.format, tags_are_tokens=prompt.tags_are_tokens)
    chat = dataclasses.replace(chat, params=msgspec.structs.replace(chat.params, grammar=grammar))
    assert hasattr(fmt, "call_opened"), "every generation API's format writes tool calls"
    return chat, ToolAnswer(fmt, prompt.format)  # type: ignore[arg-type]


class ToolAnswer:
    """An API's answer format with each choice's text read into text and calls (gateway/render.py ``AnswerFormat``)."""

    def __init__(self, inner: ToolCallFormat, fmt: ToolFormat) -> None:
        inner.expect_calls()
        self.inner = inner
        self.fmt = fmt
        self.readers: dict[int, OutputReader] = {}  # a streamed choice's reader (its calls keep their ids)

    def _reader(self, index: int) -> OutputReader:
        reader = self.readers.get(index)
        if reader is None:
            reader = self.readers[index] = OutputReader(self.fmt)
        return reader

    def _write(self, index: int, events: list[Event], logprobs: list[dict[str, Any]] | None) -> bytes:
        out: list[bytes] = []
        for event in events:
            match event:
                case TextOut(text=text):
                    out.append(self.inner.delta(index, text, logprobs))
                    logprobs = None  # sent with the first text
                case CallOpened(call=call):
                    out.append(self.inner.call_opened(index, call))
                case CallArguments(call=call, fragment=fragment):
                    out.append(self.inner.call_arguments(index, call, fragment))
        if logprobs:  # tokens of a call or held back: their entries still go out, with no text
            out.append(self.inner.delta(index, "", logprobs))
        return b"".join(out)

    def opening(self, n: int) -> bytes:
        return self.inner.opening(n)

    def delta(self, index: int, text: str, logprobs: list[dict[str, Any]] | None) -> bytes:
        return self._write(index, self._reader(index).feed(text), logprobs)

    def finished(self, index: int, reason: str, logprobs: list[dict[str, Any]] | None) -> bytes:
        reader = self._reader(index)
        head = self._write(index, reader.end(), None)
        return head + self.inner.finished(index, _reason(reason, reader.calls), logprobs)

    def failed(self, error: ShmgateError) -> bytes:
        return self.inner.failed(error)

    def closing(self, outcome: Outcome) -> bytes:
        return self.inner.closing(self._split(outcome))

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        return self.inner.whole(self._split(outcome))

    def _split(self, outcome: Outcome) -> Outcome:
        """The outcome with each choice's text without its calls, the calls beside, and their finish reasons."""
        texts, calls = [], []
        for index, text in enumerate(outcome.texts):
            reader = self.readers.get(index)
            if reader is None:  # a whole answer: read now
                reader = OutputReader(self.fmt)
                reader.feed(text)
                reader.end()
            texts.append(reader.content)
            calls.append(reader.calls)
        reasons = [_reason(r, c) for r, c in zip(outcome.finish_reasons, calls)]
        return dataclasses.replace(outcome, texts=texts, finish_reasons=reasons, tool_calls=calls)


def _reason(reason: str, calls: list[ToolCall]) -> str:
    """OpenAI's finish reason of an answer that made calls and ended by itself: ``tool_calls``."""
    return "tool_calls" if calls and reason == "stop" else reason
