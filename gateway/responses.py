"""``POST /v1/responses``: OpenAI's Responses API as a codec over the request pipeline (gateway/pipeline.py);
its row in gateway/endpoints.py makes the route.

The request becomes the engine's request through the chat path's own validation: ``input`` (a string,
or messages whose content is ``input_text`` and ``input_image`` parts; ``output_text`` parts of an
earlier answer sent back as an assistant message) turns into chat messages, ``instructions`` into a
system message in front of them, ``max_output_tokens``, ``temperature`` and ``top_p`` into sampling,
``presence_penalty``, ``frequency_penalty`` and ``top_logprobs`` (or ``include``
``message.output_text.logprobs``) as chat takes them, ``text.format`` (json_schema, json_object) into the
grammar of structured outputs (gateway/structured.py), function ``tools`` and ``tool_choice`` into the calls
a grammar forces (gateway/tools.py); ``function_call`` and ``function_call_output`` input items (an earlier
answer's calls and their results) into the conversation's calls and tool messages. Images are data URLs,
or http(s) URLs under ``--allow-image-urls``, as in chat. The answer is written by gateway/responses_format.py.

Every field is honoured or refused with a 400 naming it, never ignored:
- kept with no response store: ``store`` (only false; the default here is false, not OpenAI's true)
  and ``previous_response_id`` (refused: nothing is kept to continue from);
- echoed in the response, as OpenAI does: ``metadata``, ``user``, ``safety_identifier``,
  ``parallel_tool_calls``, ``tool_choice``, ``tools`` (function tools; built-in tools are refused naming
  ``tools[i].type``), ``truncation`` ``disabled``, ``service_tier`` ``auto`` or ``default``,
  ``text.verbosity`` ``medium``;
- refused when present: reasoning, ``include`` other than ``message.output_text.logprobs``,
  ``background``, ``conversation``, ``prompt``, ``stream_options``, the prompt-cache options and the rest of ``REFUSED``; and
  any name this server does not know (unlike chat, whose older clients send extra fields, every
  client of this API knows what it sends).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

import msgspec

from shmgate.gateway.intake import (
    ChatCompletionRequest,
    FieldNames,
    FunctionCall,
    GenerationRequest,
    ImagePart,
    ImageURL,
    IntakeLimits,
    Message,
    Part,
    TextPart,
    ToolCallPart,
    chat_request_from,
    decode_body,
)
from shmgate.gateway.render import AnswerFormat
from shmgate.gateway.responses_format import ResponsesFormat
from shmgate.gateway.tools import parse_tools
from shmgate.shared.errors import InvalidRequest

__all__ = [
    "RESPONSES",
    "REFUSED",
    "ResponsesCodec",
    "ResponsesRequest",
    "parse_responses_request",
]

Refused = Annotated[Any, msgspec.Meta(description="not supported: a 400 naming the field when present (not null)")]


class InputText(msgspec.Struct, tag="input_text", tag_field="type", forbid_unknown_fields=True):
    text: str


class InputImage(msgspec.Struct, tag="input_image", tag_field="type", forbid_unknown_fields=True):
    image_url: str | None = None  # a data URL (http(s) under --allow-image-urls)
    detail: Literal["auto", "low", "high"] | None = None
    file_id: Refused = None  # no file store for inputs


class OutputText(msgspec.Struct, tag="output_text", tag_field="type", forbid_unknown_fields=True):
    """An earlier answer's text, sent back in an assistant message for a multi-turn conversation."""

    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


InputPart = Union[InputText, InputImage, OutputText]


class InputMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]
    type: Literal["message"] | None = None
    id: str | None = None  # an earlier output message sent back carries its id and status
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(msgspec.Struct, forbid_unknown_fields=True):
    """An earlier answer's call, sent back in ``input``."""

    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    type: Literal["function_call"] = "function_call"
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(msgspec.Struct, forbid_unknown_fields=True):
    """A call's result, sent back in ``input``."""

    call_id: str
    output: str
    type: Literal["function_call_output"] = "function_call_output"
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = Annotated[
    dict[str, Any],
    msgspec.Meta(description="a message (role, content), a function_call or a function_call_output item"),
]
_ITEMS: dict[Any, type[InputMessage | FunctionCallItem | FunctionCallOutputItem]] = {
    None: InputMessage,
    "message": InputMessage,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


class TextConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    verbosity: Literal["medium"] | None = None  # the only verbosity of a model that is not a reasoning model


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    store: Annotated[bool | None, msgspec.Meta(description="only false: no response is stored")] = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: Annotated[
        Any, msgspec.Meta(description='"none", "auto", "required" or {"type": "function", "name"}')
    ] = None
    tools: Annotated[list[Any] | None, msgspec.Meta(description="function tools; built-in tools are refused")] = None
    truncation: Literal["disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_logprobs: int | None = None  # > 0, or include's logprobs: each token's log-probability and its likeliest
    include: list[str] | None = None  # only LOGPROBS_INCLUDE
    # REFUSED: decoded with the rest, so refusing them costs no second pass
    previous_response_id: Refused = None
    conversation: Refused = None
    reasoning: Refused = None
    background: Refused = None
    prompt: Refused = None
    stream_options: Refused = None
    max_tool_calls: Refused = None
    prompt_cache_key: Refused = None
    prompt_cache_retention: Refused = None
    prompt_cache_options: Refused = None
    context_management: Refused = None


# What each refused field would ask of a server: the 400's reason.
REFUSED: dict[str, str] = {
    "previous_response_id": "this server keeps no responses to continue from; send the conversation in input",
    "conversation": "this server keeps no conversations; send the conversation in input",
    "reasoning": "reasoning options are not supported: these models do not reason before answering",
    "background": "background responses need a response store, which this server does not have",
    "prompt": "stored prompt templates are not supported; send instructions and input",
    "stream_options": "stream options are not supported",
    "max_tool_calls": "a bound on the calls is not supported; parallel_tool_calls: false allows one",
    "prompt_cache_key": "prompt cache options are not supported",
    "prompt_cache_retention": "prompt cache options are not supported",
    "prompt_cache_options": "prompt cache options are not supported",
    "context_management": "context management is not supported",
}

LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one extra output this server can include
MAX_METADATA_PAIRS = 16  # OpenAI's bounds on metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

_decoder = msgspec.json.Decoder(ResponsesRequest)
_UNKNOWN = re.compile(r"unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")


def parse_responses_request(body: bytes, limits: IntakeLimits) -> tuple[GenerationRequest, ResponsesRequest]:
    """The engine's request and the parsed body (its echoed fields). Raises RequestError subclasses
    naming the Responses API's own fields."""
    req = _decode(body)
    _check_refused(req)
    if isinstance(req.input, list):
        messages = _messages([_item(i, item) for i, item in enumerate(req.input)])
    else:
        messages = [Message("user", req.input)]
    if not messages:
        raise InvalidRequest("input must not be empty", param="input")
    if req.max_output_tokens is not None and not 1 <= req.max_output_tokens <= 1 << 20:
        raise InvalidRequest(f"max_output_tokens must be between 1 and {1 << 20}", param="max_output_tokens")
    if req.instructions is not None and len(req.instructions) > limits.max_text_chars:
        raise InvalidRequest(f"instructions are longer than {limits.max_text_chars} characters", param="instructions")
    chat_form = ChatCompletionRequest(
        req.model,
        messages,
        stream=req.stream,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        user=req.user,
        response_format=_response_format(req.text),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logprobs=True if _wants_logprobs(req) else None,
        top_logprobs=req.top_logprobs if _wants_logprobs(req) else None,
    )
    chat = chat_request_from(chat_form, limits, _STRING_NAMES if isinstance(req.input, str) else _NAMES)
    chat = dataclasses.replace(chat, tools=parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls, flat=True))
    if req.instructions:  # in front of the conversation, as OpenAI places them
        system = {"role": "system", "content": [{"type": "text", "text": req.instructions}]}
        chat = dataclasses.replace(chat, messages=[system, *chat.messages])
    return chat, req


def _wants_logprobs(req: ResponsesRequest) -> bool:
    """Log-probabilities are returned for ``include``'s logprobs, or for a ``top_logprobs`` above 0."""
    return bool(req.top_logprobs) or LOGPROBS_INCLUDE in (req.include or ())


def _decode(body: bytes) -> ResponsesRequest:
    """Decode, naming an unknown field as the param (``$.foo`` / ``$.input[0].bar``) of its 400."""
    try:
        req: ResponsesRequest = _decoder.decode(body)
        return req
    except msgspec.ValidationError as exc:
        match = _UNKNOWN.search(str(exc))
        if match is None:
            return decode_body(_decoder, body)  # raises the InvalidRequest naming the field msgspec names
        where = match.group(2)
        name = f"{where}.{match.group(1)}" if where else match.group(1)
        raise InvalidRequest(
            f"Unrecognized request argument supplied: {match.group(1)} (not supported by this server)", param=name
        ) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return decode_body(_decoder, body)  # raises the InvalidRequest saying why


def _check_refused(req: ResponsesRequest) -> None:
    for name, reason in REFUSED.items():
        if getattr(req, name) is not None:
            raise InvalidRequest(f"{name} is not supported: {reason}", param=name)
    if req.store:
        raise InvalidRequest(
            "store: true is not supported: this server keeps no responses; leave store out or send false",
            param="store",
        )
    for item in req.include or ():
        if item != LOGPROBS_INCLUDE:
            raise InvalidRequest(
                f"include {item[:60]!r} is not supported: only {LOGPROBS_INCLUDE!r} is available", param="include"
            )
    if req.metadata is not None and (
        len(req.metadata) > MAX_METADATA_PAIRS
        or any(len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS for k, v in req.metadata.items())
    ):
        raise InvalidRequest(
            f"metadata takes at most {MAX_METADATA_PAIRS} pairs, keys of at most {MAX_METADATA_KEY_CHARS} "
            f"and values of at most {MAX_METADATA_VALUE_CHARS} characters",
            param="metadata",
        )


def _item(i: int, item: dict[str, Any]) -> InputMessage | FunctionCallItem | FunctionCallOutputItem:
    """One ``input`` item as its type; a failure names the item's field (``input[2].call_id``)."""
    kind = item.get("type")
    cls = _ITEMS.get(kind)
    if cls is None:
        raise InvalidRequest(
            f"input items are messages, function_call or function_call_output, not {str(kind)[:40]!r}",
            param=f"input[{i}].type",
        )
    try:
        return msgspec.convert(item, cls)
    except msgspec.ValidationError as exc:
        match = _UNKNOWN.search(str(exc))
        if match is not None:
            where = f"input[{i}]" + (f".{match.group(2)}" if match.group(2) else "")
            raise InvalidRequest(
                f"Unrecognized request argument supplied: {match.group(1)} (not supported by this server)",
                param=f"{where}.{match.group(1)}",
            ) from None
        at = re.search(r"at `\$\.?([^`]*)`", str(exc))
        raise InvalidRequest(
            f"invalid request: {exc}", param=f"input[{i}]" + (f".{at.group(1)}" if at and at.group(1) else "")
        ) from None


def _messages(items: list[InputMessage | FunctionCallItem | FunctionCallOutputItem]) -> list[Message]:
    """The input items as chat messages: calls join the assistant message before them (or make one), a
    call's output is a tool message. Each message keeps its item's index, so errors name the same place."""
    messages: list[Message] = []
    for i, item in enumerate(items):
        if isinstance(item, InputMessage):
            messages.append(_message(i, item))
            continue
        if isinstance(item, FunctionCallOutputItem):
            messages.append(Message("tool", item.output, tool_call_id=item.call_id))
            continue
        call = ToolCallPart(item.call_id, FunctionCall(item.name, item.arguments))
        last = messages[-1] if messages else None
        if (
            last is not None
            and last.role == "assistant"
            and (last.tool_calls or isinstance(items[i - 1], InputMessage))
        ):
            last.tool_calls = [*(last.tool_calls or []), call]
        else:
            messages.append(Message("assistant", "", tool_calls=[call]))
    return messages


def _message(i: int, message: InputMessage) -> Message:
    """One input message as a chat message (its parts at the same indices, so errors name the same place)."""
    if isinstance(message.content, str):
        return Message(message.role, message.content)
    parts: list[Part] = []
    for part in message.content:
        if isinstance(part, InputText):
            parts.append(TextPart(part.text))
        elif isinstance(part, OutputText):
            parts.append(TextPart(part.text))
        else:
            parts.append(ImagePart(ImageURL(part.image_url or "", part.detail)))
    for j, part in enumerate(message.content):  # checked here, where the input's own names are known
        if isinstance(part, OutputText) and message.role != "assistant":
            raise InvalidRequest("output_text parts belong to assistant messages", param=f"input[{i}].content[{j}]")
        if isinstance(part, InputImage):
            if part.file_id is not None:
                raise InvalidRequest(
                    "file_id is not supported: send image_url as a data URL (data:image/jpeg;base64,...)",
                    param=f"input[{i}].content[{j}].file_id",
                )
            if not part.image_url:
                raise InvalidRequest(
                    "input_image needs image_url (a data URL: data:image/jpeg;base64,...)",
                    param=f"input[{i}].content[{j}].image_url",
                )
    return Message(message.role, parts)


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """``text.format`` in the chat form gateway/structured.py reads (json_schema's fields one level down)."""
    if text is None or text.format is None:
        return None
    fmt = text.format
    kind = fmt.get("type")
    known = _FORMAT_KEYS.get(kind if isinstance(kind, str) else "", {"type"})
    unknown = sorted(set(fmt) - known)
    if unknown:
        raise InvalidRequest(f"text.format has no field {unknown[0][:40]!r}", param="text.format")
    if kind != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


_FIELDS: Mapping[str, str] = {
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "logprobs": "top_logprobs",
}
# This API's names of the chat request's places: ``input[i].content[j].image_url`` (an input_image's own
# field), ``input[i].content[j].detail``; a string input is ``input`` itself.
_NAMES = FieldNames(messages="input", detail=".detail", fields=_FIELDS)
_STRING_NAMES = FieldNames(messages="input", detail=".detail", one_string=True, fields=_FIELDS)
# the members of each text.format type (OpenAI's); another is a 400, not ignored
_FORMAT_KEYS = {"json_schema": {"type", "name", "schema", "strict", "description"}}


class ResponsesCodec:
    """The Responses API: ``parse`` and its answer's format (gateway/responses_format.py)."""

    fields = _FIELDS

    def parse(self, body: bytes, limits: IntakeLimits) -> tuple[GenerationRequest, AnswerFormat]:
        chat, req = parse_responses_request(body, limits)
        return chat, ResponsesFormat(req)


RESPONSES = ResponsesCodec()
