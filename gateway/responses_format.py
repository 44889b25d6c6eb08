"""The Responses API's answer: the ``response`` object, whole or as the event stream OpenAI's SDKs read.

A stream is, in order (each event with its ``sequence_number``, framed ``event: <type>`` /
``data: <json>`` as OpenAI frames it):

    response.created, response.in_progress          the response, status in_progress, no output yet
    response.output_item.added                      the assistant message, empty
    response.content_part.added                     its output_text part, empty
    response.output_text.delta ...                  the text as it is generated
    response.output_text.done                       the whole text
    response.content_part.done, response.output_item.done
    response.completed | response.incomplete        the whole response, with usage
    data: [DONE]                                    the Open Responses terminal event (OpenAI's SDK stops there)

``incomplete`` (``incomplete_details.reason`` ``max_output_tokens``) is an answer cut by
``max_output_tokens``; a failure after the stream began ends it with ``response.failed``, whose
response carries the error (and ``data: [DONE]`` follows it too). The answer has one output message
(the API has no ``n``). Every field the Open Responses specification requires of a response object is
present: settings this server does not have are their neutral values (``reasoning`` null, ``background``
false, ``max_tool_calls`` and ``prompt_cache_key`` null), and ``completed_at`` is set once it completed.
With ``top_logprobs`` or ``include: ["message.output_text.logprobs"]`` each ``output_text`` carries its
tokens' log-probabilities, on the delta events too.

response carries the error. The answer has one output message (the API has no ``n``).

With function tools (gateway/tool_answer.py ``ToolAnswer`` reads the calls out of the text) the output is
the message, only when there is text, then one ``function_call`` item per call (``call_id``, ``name``,
``arguments``). Streamed, the message's events come when its first text does, and each call is
``response.output_item.added`` (arguments ""), ``response.function_call_arguments.delta`` ...,
``response.function_call_arguments.done``, ``response.output_item.done``.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec

from shmgate.shared.errors import ShmgateError

if TYPE_CHECKING:
    from shmgate.gateway.render import Outcome
    from shmgate.gateway.responses import ResponsesRequest
    from shmgate.gateway.tool_output import ToolCall

__all__ = ["ResponsesFormat"]

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


class ResponsesFormat:
    """Builds one response's objects and events (gateway/render.py ``AnswerFormat``)."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req = req
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.sequence = 0
        self.calls_possible = False  # tools: the message opens with its first text (``expect_calls``)
        self._items: list[dict[str, Any]] = []  # streamed with tools: the output items opened, in order
        self._text: list[str] = []  # the open message's text so far
        self._call_items: dict[str, str] = {}  # a call's id -> its item's id
        self.logprobs: list[dict[str, Any]] = []  # the entries sent so far on delta events (a stream)

    # -- objects -------------------------------------------------------------------

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The ``response`` object; the request's settings echoed as OpenAI echoes them."""
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "model": req.model,
            "output": output,
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "background": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "presence_penalty": req.presence_penalty or 0.0,
            "frequency_penalty": req.frequency_penalty or 0.0,
            "top_logprobs": req.top_logprobs or 0,
            "text": {
                "format": {"type": "text"} if req.text is None or req.text.format is None else req.text.format,
                "verbosity": "medium",
            },
            "tool_choice": req.tool_choice or "auto",
            "tools": [
                {"strict": None, "description": None, "parameters": None, **t}
                for t in req.tools or []
                if isinstance(t, dict)
            ],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "service_tier": req.service_tier or "default",
            "usage": usage,
            "user": req.user,
            "safety_identifier": req.safety_identifier,
            "prompt_cache_key": None,
            "metadata": req.metadata or {},
        }

    def message(self, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The output message item; ``text`` None: no content part yet."""
        content = [] if text is None else [self.part(text, logprobs)]
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    @staticmethod
    def usage(outcome: Outcome) -> dict[str, Any]:
        return {
            "input_tokens": outcome.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": outcome.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        }

    def final(self, outcome: Outcome) -> dict[str, Any]:
        """The finished response: ``incomplete`` when max_output_tokens cut its text."""
        status = "incomplete" if outcome.finish_reasons[0] == "length" else "completed"
        calls = outcome.tool_calls[0] if outcome.tool_calls else []
        output = (
            [self.message(outcome.texts[0], status, self._logprobs(outcome))] if outcome.texts[0] or not calls else []
        )
        output += [self.function_call(call, status) for call in calls]
        return self.response(status, output, self.usage(outcome))

    def _logprobs(self, outcome: Outcome) -> list[dict[str, Any]]:
        """Every token's entry: those sent on delta events, then those not sent (all of them, unstreamed)."""
        return self.logprobs + (outcome.logprobs[0] if outcome.logprobs else [])

    def function_call(self, call: ToolCall, status: str) -> dict[str, Any]:
        """A call's output item."""
        item_id = self._call_items.setdefault(call.id, f"fc_{uuid.uuid4().hex}")
        return {
            "id": item_id,
            "type": "function_call",
            "status": status,
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
        }

    # -- the stream ----------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json.encode(body) + b"\n\n"

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def expect_calls(self) -> None:
        """The answer may hold calls: the message is opened by its first text, not at the start."""
        self.calls_possible = True

    def opening(self, n: int) -> bytes:
        started = self.response("in_progress", [])
        if self.calls_possible:
            return self.event("response.created", response=started) + self.event(
                "response.in_progress", response=started
            )
        return b"".join(
            (
                self.event("response.created", response=started),
                self.event("response.in_progress", response=started),
                self.event("response.output_item.added", output_index=0, item=self.message(None, "in_progress")),
                self.event("response.content_part.added", **self._at(), part=self.part("")),
            )
        )

    def delta(self, index: int, text: str, logprobs: list[dict[str, Any]] | None) -> bytes:
        self.logprobs.extend(logprobs or ())
        if self.calls_possible:
            head = b""
            if not text:
                return b""
            if not self._items or self._items[-1]["type"] != "message":
                head = self._close_item() + self._open_message()
            self._text.append(text)
            at = {"item_id": self.item_id, "output_index": len(self._items) - 1, "content_index": 0}
            return head + self.event("response.output_text.delta", **at, delta=text, logprobs=logprobs or [])
        return self.event("response.output_text.delta", **self._at(), delta=text, logprobs=logprobs or [])

    def _open_message(self) -> bytes:
        item = self.message(None, "in_progress")
        self._items.append(item)
        at = len(self._items) - 1
        return self.event("response.output_item.added", output_index=at, item=item) + self.event(
            "response.content_part.added", item_id=self.item_id, output_index=at, content_index=0, part=self.part("")
        )

    def _close_item(self, status: str = "completed") -> bytes:
        """The done events of the open item (the message, or a call), if one is open."""
        if not self._items or self._items[-1]["status"] != "in_progress":
            return b""
        item, at = self._items[-1], len(self._items) - 1
        item["status"] = status
        if item["type"] == "message":
            text = "".join(self._text)
            where = {"item_id": self.item_id, "output_index": at, "content_index": 0}
            item["content"] = [self.part(text)]
            return b"".join(
                (
                    self.event("response.output_text.done", **where, text=text, logprobs=[]),
                    self.event("response.content_part.done", **where, part=self.part(text)),
                    self.event("response.output_item.done", output_index=at, item=item),
                )
            )
        return self.event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=at,
            name=item["name"],
            arguments=item["arguments"],
        ) + self.event("response.output_item.done", output_index=at, item=item)

    def call_opened(self, index: int, call: ToolCall) -> bytes:
        head = self._close_item()
        item = {**self.function_call(call, "in_progress"), "arguments": ""}  # its fragments follow
        self._items.append(item)
        return head + self.event("response.output_item.added", output_index=len(self._items) - 1, item=item)

    def call_arguments(self, index: int, call: ToolCall, fragment: str) -> bytes:
        item = self._items[-1]
        item["arguments"] += fragment
        return self.event(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=len(self._items) - 1,
            delta=fragment,
        )

    def finished(self, index: int, reason: str, logprobs: list[dict[str, Any]] | None) -> bytes:
        self.logprobs.extend(logprobs or ())  # tokens with no text of their own (EOS): in the done events only
        return b""  # the done events carry the whole text: written by ``closing``

    def closing(self, outcome: Outcome) -> bytes:
        final = self.final(outcome)
        if self.calls_possible:
            status = final["status"]
            return self._close_item(status) + self.event(f"response.{status}", response=final)
        text = outcome.texts[0]
        part = final["output"][0]["content"][0]
        return b"".join(
            (
                self.event("response.output_text.done", **self._at(), text=text, logprobs=part["logprobs"]),
                self.event("response.content_part.done", **self._at(), part=part),
                self.event("response.output_item.done", output_index=0, item=final["output"][0]),
                self.event(f"response.{final['status']}", response=final),
                DONE,
            )
        )

    def failed(self, error: ShmgateError) -> bytes:
        code = "server_error"
        if error.status_hint == 429:
            code = "rate_limit_exceeded"
        elif error.status_hint < 500:
            code = "invalid_prompt"
        failed = self.response("failed", [], error={"code": code, "message": error.message})
        return self.event("response.failed", response=failed) + DONE

    def whole(self, outcome: Outcome) -> dict[str, Any]:
        return self.final(outcome)
