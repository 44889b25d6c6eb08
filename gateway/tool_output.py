"""A model's answer read back into text and tool calls, as it streams.

The grammar (gateway/tools.py) makes every call the family's exact shape (shared/families/tool_formats.py),
``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`` for hermes, so the reader needs no
JSON parser: it passes text through until a call's opening tag, reads the name, then passes the
arguments through as fragments until the call's closing suffix. Whatever could still turn out to be a
tag is held back until the next piece decides it (a few characters), so a stream never shows a client
part of a tag as text, nor the call's closing brace as arguments. A call cut short (``max_tokens``)
keeps the arguments it had (one cut before them is dropped); text that is not a call's shape stays text.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Literal

from shmgate.shared.families.tool_formats import ToolFormat

__all__ = ["CallArguments", "CallOpened", "OutputReader", "TextOut", "ToolCall", "split_output"]

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\S)')
_MAX_HEAD_CHARS = 256  # a call's head longer than this is not the shape the grammar writes: text


@dataclass
class ToolCall:
    """One call of the answer: its place among the choice's calls, id, function and arguments (JSON text)."""

    index: int
    id: str
    name: str
    arguments: str = ""


@dataclass(frozen=True)
class TextOut:
    text: str


@dataclass(frozen=True)
class CallOpened:
    call: ToolCall


@dataclass(frozen=True)
class CallArguments:
    call: ToolCall
    fragment: str


Event = TextOut | CallOpened | CallArguments


def _held(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a beginning of ``marker`` (it may become it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class OutputReader:
    """One choice's answer, fed piece by piece; ``content`` and ``calls`` are what it read so far."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self._content: list[str] = []
        self._state: Literal["text", "head", "arguments", "between"] = "text"
        self._buffer = ""

    @property
    def content(self) -> str:
        return "".join(self._content)

    def feed(self, text: str) -> list[Event]:
        """The events ``text`` completes (text, a call opened, argument fragments)."""
        self._buffer += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def end(self) -> list[Event]:
        """The answer ended: what was held back, as what it was heading to be."""
        events: list[Event] = []
        rest, self._buffer = self._buffer, ""
        if not rest:
            return events
        if self._state == "arguments":
            self._arguments(rest, events)
        elif self._state == "head":  # a call cut before its arguments began (max_tokens): no call, and not text
            pass
        else:
            self._text(rest, events)
        return events

    def _text(self, text: str, events: list[Event]) -> None:
        if text:
            self._content.append(text)
            events.append(TextOut(text))

    def _arguments(self, fragment: str, events: list[Event]) -> None:
        if fragment:
            call = self.calls[-1]
            call.arguments += fragment
            events.append(CallArguments(call, fragment))

    def _step(self, events: list[Event]) -> bool:
        """Move on as far as the buffer decides; False when it must wait for more."""
        fmt, buffer = self.fmt, self._buffer
        if self._state == "between":  # after a call: the next one, or (not the grammar's shape) text
            opening = fmt.separator + fmt.call_open
            if buffer.startswith(opening):
                self._buffer, self._state = buffer[len(opening) :], "head"
                return True
            if opening.startswith(buffer):
                return False  # the separator, or a beginning of the next call: wait
            self._state = "text"
            return True
        if self._state == "text":
            at = buffer.find(fmt.call_open)
            if at < 0:
                keep = _held(buffer, fmt.call_open)
                self._text(buffer[: len(buffer) - keep], events)
                self._buffer = buffer[len(buffer) - keep :]
                return False
            self._text(buffer[:at], events)
            self._buffer, self._state = buffer[at + len(fmt.call_open) :], "head"
            return True
        if self._state == "head":
            match = _HEAD.match(buffer)
            if match is None:
                if len(buffer) > _MAX_HEAD_CHARS or "}" in buffer:  # not a call after all: text
                    self._text(fmt.call_open + buffer, events)
                    self._buffer, self._state = "", "text"
                return False
            call = ToolCall(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", match.group(1))
            self.calls.append(call)
            events.append(CallOpened(call))
            self._buffer, self._state = buffer[match.end() :], "arguments"
            return True
        # arguments: up to the call's closing suffix (a literal newline cannot occur in compact JSON)
        suffix = fmt.call_suffix
        at = buffer.find(suffix)
        if at < 0:
            keep = _held(buffer, suffix)
            self._arguments(buffer[: len(buffer) - keep], events)
            self._buffer = buffer[len(buffer) - keep :]
            return False
        self._arguments(buffer[:at], events)
        self._buffer, self._state = buffer[at + len(suffix) :], "between"
        return True


def split_output(text: str, fmt: ToolFormat) -> tuple[str, list[ToolCall]]:
    """A whole answer's text and calls."""
    reader = OutputReader(fmt)
    reader.feed(text)
    reader.end()
    return reader.content, reader.calls
