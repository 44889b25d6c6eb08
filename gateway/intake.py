"""OpenAI chat request -> GenerationRequest: parsing and validation of what clients send.

``GenerationRequest`` is the engine's request, the same for every endpoint (DESIGN §4c): the chat
body parses into it here, a Responses body (gateway/responses.py) through the same validation with
its own field names (``FieldNames``), an embedding input (gateway/embeddings.py) directly.

Client-facing types are plain JSON msgspec Structs (not array_like). Every
field a request may carry is either honoured or refused with a 400 naming it
(gateway/fields.py decides per model). Every failure is a RequestError naming
the offending ``param``; nothing here reaches shared memory.

Unknown fields, the rule:
- Refused (400, ``param`` = the field): every name that would change the answer's *form* if a
  server honoured it, so that a client asking for it never gets free text it takes for the
  thing it asked for: ``FORM_FIELDS`` (vLLM's structured-output names ``guided_*``,
  ``structural_tag``, ``structured_outputs``; OpenAI's ``audio``, ``prediction``,
  ``web_search_options``; vLLM's ``prompt_logprobs``, ``logits_processors``, a true ``echo``),
  ``modalities`` other than ``["text"]``, and the legacy ``functions`` and ``function_call`` (send
  ``tools``); ``response_format`` becomes a grammar (gateway/structured.py), ``tools`` and ``tool_choice``
  the calls a grammar forces (gateway/tools.py).
  ``null`` counts as absent, as vLLM and OpenAI's SDKs treat it.
- Ignored, and logged once per name per process: any other name. OpenAI's SDKs and the
  frameworks on top of them send fields a server may not know (``store``, ``metadata``,
  ``service_tier``, ``reasoning_effort``, ``safety_identifier``, a newer SDK's additions);
  none of them changes what the answer is, and refusing them would break ordinary clients.
  This is the OpenAI API's own forward-compatibility rule for servers.
The refused names are fields of ``ChatCompletionRequest`` (decoded once, with the rest), so
refusing them costs no second decode; only the warning for ignored names reads the keys again.
"""

from __future__ import annotations

import binascii
import importlib
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

import msgspec

from shmgate.gateway.structured import grammar_for
from shmgate.gateway.tools import ToolCalling, parse_tools
from shmgate.gateway.video import ACCEPTED_VIDEO_TYPES, VIDEO_DETAIL  # video parts (gateway/video.py)
from shmgate.shared.errors import ImageTooLarge, InvalidRequest, RequestError, TooManyImages, UndecodableImage
from shmgate.shared.vocabulary import material_digest
from shmgate.shared.wire import MAX_TOP_LOGPROBS, MIN_TEMPERATURE, SamplingParams

__all__ = [
    "ChatCompletionRequest",
    "CHAT_NAMES",
    "FieldNames",
    "GenerationRequest",
    "Message",
    "add_image",
    "chat_request_from",
    "data_url_image",
    "decode_body",
    "decode_chat_request",
    "parse_chat_body",
    "EncodedImage",
    "FORM_FIELDS",
    "IntakeLimits",
    "LOOP_HASH_MAX_BYTES",
    "PendingImageURL",
    "image_bytes",
    "image_digest",
    "key_material",
    "parse_chat_request",
    "strict_b64decode",
]

ACCEPTED_IMAGE_TYPES = ("image/jpeg", "image/jpg", "image/png", "image/webp")
_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+)?((?:;[\w-]+=[^;,]*)*)(;base64)?,", re.IGNORECASE)


class ImageURL(msgspec.Struct):
    url: str
    detail: str | None = None


class TextPart(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImagePart(msgspec.Struct, tag="image_url", tag_field="type"):
    image_url: ImageURL


class VideoURL(msgspec.Struct):
    url: str


class VideoPart(msgspec.Struct, tag="video_url", tag_field="type"):  # vLLM's form; gateway/video.py
    video_url: VideoURL


Part = Union[TextPart, ImagePart, VideoPart]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's form)


class ToolCallPart(msgspec.Struct):
    """An earlier answer's call, sent back in an assistant message's ``tool_calls``."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(msgspec.Struct):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list[ToolCallPart] | None = None  # assistant messages: the calls it made
    tool_call_id: str | None = None  # tool messages: the call this is the result of


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None  # null as false: OpenAI's schema lets optional fields be null


# A field that would change the answer's form if honoured, which no model here does (FORM_FIELDS);
# the description reaches /openapi.json (gateway/openapi.py).
Refused = Annotated[Any, msgspec.Meta(description="not supported: a 400 naming the field when present (not null)")]


class ChatCompletionRequest(msgspec.Struct):
    model: str
    messages: list[Message]
    stream: bool | None = None  # null is false (OpenAI's schema allows it)
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    user: str | None = None
    # Known, and either honoured or refused per model (gateway/fields.py): never accepted and ignored.
    logprobs: bool | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension: token ids that end the answer
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's: image processor arguments (gateway/fields.py)
    modalities: Annotated[Any, msgspec.Meta(description='only ["text"] is accepted')] = None  # OpenAI's
    echo: Annotated[Any, msgspec.Meta(description="only false is accepted")] = None  # vLLM's
    # FORM_FIELDS: refused whenever present (not null); decoded with the rest, so checking them is free.
    guided_json: Refused = None
    guided_regex: Refused = None
    guided_choice: Refused = None
    guided_grammar: Refused = None
    guided_decoding_backend: Refused = None
    guided_whitespace_pattern: Refused = None
    structural_tag: Refused = None
    structured_outputs: Refused = None
    audio: Refused = None
    prediction: Refused = None
    web_search_options: Refused = None
    prompt_logprobs: Refused = None
    logits_processors: Refused = None


# Request fields that would change the form of the answer in a way no model here does: refused when
# present, each with what the server does instead (the message reads "<field> (<this>)").
_USE_RESPONSE_FORMAT = (
    "vLLM's guided decoding is not supported by this server; for JSON answers send response_format "
    '{"type": "json_schema", ...} or {"type": "json_object"}'
)
_NO_OTHER_FORMATS = (
    "regular-expression, choice and grammar formats are not supported by this server; "
    "for JSON answers send response_format"
)
FORM_FIELDS: dict[str, str] = {
    "guided_json": _USE_RESPONSE_FORMAT,
    "guided_regex": _NO_OTHER_FORMATS,
    "guided_choice": _NO_OTHER_FORMATS,
    "guided_grammar": _NO_OTHER_FORMATS,
    "guided_decoding_backend": _USE_RESPONSE_FORMAT,
    "guided_whitespace_pattern": _USE_RESPONSE_FORMAT,
    "structural_tag": _NO_OTHER_FORMATS,
    "structured_outputs": _USE_RESPONSE_FORMAT,
    "audio": "audio output is not supported by this server",
    "prediction": "predicted outputs are not supported by this server",
    "web_search_options": "web search is not supported by this server",
    "prompt_logprobs": "prompt log probabilities are not supported by this server",
    "logits_processors": "custom logits processors are not supported by this server",
}


_decoder = msgspec.json.Decoder(ChatCompletionRequest)


@dataclass(frozen=True)
class IntakeLimits:
    max_images: int = 8
    max_image_bytes: int = 20 << 20  # decoded from base64
    max_text_chars: int = 1 << 20
    max_parts: int = 256
    max_messages: int = 256
    allow_image_urls: bool = False  # http(s) URLs become PendingImageURLs (gateway/fetch.py) instead of a 400


@dataclass(frozen=True)
class PendingImageURL:
    """An http(s) image still to be fetched; ``GenerationRequest.images[index]`` is b"" until then."""

    index: int
    url: str
    param: str


@dataclass(frozen=True, eq=False)
class EncodedImage:
    """A data URL's image, still base64 text: decoded only when the content cache misses.

    Why: base64-decoding a 150 KB photo costs ~0.3 ms of CPU, hashing its text ~0.09 ms. The
    frontend keys data-URL images on this text (``shared.cache.content_key``), so a repeated image
    is never base64-decoded either, and a miss decodes in the decode pool instead of on the loop.
    The prefix, type and an upper bound of the size are checked at intake; the alphabet and
    padding when ``decode`` runs.
    """

    text: str  # the base64 payload after the comma, as sent
    max_bytes: int

    def decode(self) -> bytes:
        """The image bytes. Raises InvalidRequest, UndecodableImage or ImageTooLarge.

        The errors carry no ``param``: the frontend names the image (``GenerationRequest.image_params``).
        """
        try:
            data = strict_b64decode(self.text)
        except (binascii.Error, ValueError):
            data = self._decode_wrapped()
        if not data:
            raise UndecodableImage("the image is empty")
        if len(data) > self.max_bytes:
            raise ImageTooLarge(f"the image is larger than {self.max_bytes} bytes")
        return data

    _digest: bytes | None = field(default=None, init=False, repr=False)

    @property
    def digest(self) -> bytes:
        """``material_digest`` of the text, computed once however often the image is keyed (its answer's
        key with a result cache, then its tensors' key): hashing a 1024 px photo's text costs ~0.14 ms.

        Not ``functools.cached_property``: on Python 3.11 it holds one lock for every instance while it
        computes, which would serialize the decode pool's hashing of large images. Two threads that
        race here both hash and store the same digest.
        """
        if self._digest is None:
            object.__setattr__(self, "_digest", material_digest(self.text))
        assert self._digest is not None
        return self._digest

    def _decode_wrapped(self) -> bytes:
        """Base64 with line breaks or spaces in it, as some encoders write it (the slow path)."""
        try:
            return binascii.a2b_base64("".join(self.text.split()), strict_mode=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest("the image data URL is not valid base64") from None


def _simd_b64decode() -> Callable[..., bytes] | None:
    """pybase64's decoder when it is installed (optional: ``pip install pybase64``), else None.

    Why: binascii decodes base64 at ~0.4 GB/s, ~0.5 ms of a 1024 px photo's cache miss (a tenth of
    the frontend's CPU for it); pybase64's SIMD decoder takes ~10 us for the same text.
    """
    try:
        module = importlib.import_module("pybase64")
    except ImportError:
        return None
    decoder: Callable[..., bytes] = module.b64decode
    return decoder


_simd_decode = _simd_b64decode()


def strict_b64decode(text: str) -> bytes:
    """``binascii.a2b_base64(text, strict_mode=True)``, through pybase64 when it is installed.

    pybase64's ``validate=True`` accepts a subset of what strict mode accepts, with the same bytes
    (tests/test_intake_cost.py checks every string of up to five characters of a tricky alphabet);
    whatever it refuses goes to binascii, so errors and their messages are the same either way.
    """
    if _simd_decode is not None:
        try:
            return _simd_decode(text, validate=True)
        except (binascii.Error, ValueError):
            pass
    return binascii.a2b_base64(text, strict_mode=True)


MAX_N = 16  # choices per request (gateway/choices.py): each is a request in flight, so the bound is small

# Key material up to this size is hashed on the event loop (a few hundred µs at most); larger, in a thread.
LOOP_HASH_MAX_BYTES = 1 << 20


def key_material(image: bytes | EncodedImage) -> bytes | str:
    """What the content cache hashes for an image: a data URL's base64 text, a fetched image's bytes."""
    return image.text if isinstance(image, EncodedImage) else image


def image_digest(image: bytes | EncodedImage) -> bytes:
    """``material_digest(key_material(image))``, kept with a data URL's image so it is hashed once."""
    return image.digest if isinstance(image, EncodedImage) else material_digest(image)


def image_bytes(image: bytes | EncodedImage) -> bytes:
    """The image file's bytes, base64-decoding a data URL's text (raises as ``EncodedImage.decode``)."""
    return image.decode() if isinstance(image, EncodedImage) else image


@dataclass(frozen=True)
class GenerationRequest:
    """The engine's request, whichever endpoint it came from: what the pipeline (gateway/pipeline.py)
    checks, fetches, keys and submits. Every field but ``model`` has the empty default, so an endpoint
    sets what it has (an embedding input: its one image or text and ``task``)."""

    model: str
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat-template form; images as {"type": "image"}
    images: list[bytes | EncodedImage] = field(default_factory=list)  # bytes: fetched from an http(s) URL
    image_params: list[str] = field(default_factory=list)  # the field each image came from, as the client named it
    params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False  # the answer as events while it is generated, or whole at the end
    text: str = ""  # all user text, joined
    pending_urls: list[PendingImageURL] = field(default_factory=list)  # filled by gateway.fetch.fetch_pending
    task: str = ""  # Submit.task: "" for a chat answer, shared.wire.TASK_EMBED (gateway/embeddings.py)
    n: int = 1  # choices wanted (gateway/choices.py)
    image_details: list[str | None] = field(default_factory=list)  # each image's image_url.detail
    processor_kwargs: dict[str, Any] | None = None  # the request's mm_processor_kwargs
    # Each image's processor arguments (detail and mm_processor_kwargs, gateway/fields.py); empty: none.
    image_options: list[dict[str, Any]] = field(default_factory=list)
    tools: ToolCalling | None = None  # the functions the answer may call (gateway/tools.py); None: none
    # The chat template's extra arguments (``tools``, an operator's ``chat_template``: gateway/tool_prompt.py)
    template_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FieldNames:
    """What an endpoint calls the places of a chat request, so a 400 names the field as its client sent it.

    Chat's are ``CHAT_NAMES``; the Responses API's (gateway/responses.py) call the messages ``input``,
    an image's detail ``input[i].content[j].detail``, and a string input is ``input`` itself.
    ``fields``: the top-level sampling fields renamed (``max_tokens`` is ``max_output_tokens``).
    """

    messages: str = "messages"
    image: str = ".image_url"  # after ``messages[i].content[j]``
    detail: str = ".image_url.detail"
    video: str = ".video_url"
    one_string: bool = False  # the conversation was one string: every place in it is ``messages`` itself
    fields: Mapping[str, str] = field(default_factory=dict)

    def top(self, name: str) -> str:
        """A top-level field's name here."""
        return self.fields.get(name, name)

    def part(self, i: int, j: int | None = None, leaf: str = "") -> str:
        """``messages[i].content[j]<leaf>`` in this endpoint's names (``j`` None: the message's content)."""
        if self.one_string:
            return self.messages
        if j is None:
            return f"{self.messages}[{i}].content"
        return f"{self.messages}[{i}].content[{j}]{leaf}"


CHAT_NAMES = FieldNames()


class _ChatWithoutExtras(ChatCompletionRequest, forbid_unknown_fields=True):
    """The request type that refuses unknown top-level fields: the one-pass decode of the usual body."""


_exact_decoder = msgspec.json.Decoder(_ChatWithoutExtras)


def parse_chat_request(body: bytes, limits: IntakeLimits) -> GenerationRequest:
    """Parse and validate a request body. Raises RequestError subclasses."""
    return parse_chat_body(body, limits)[0]


def parse_chat_body(body: bytes, limits: IntakeLimits) -> tuple[GenerationRequest, ChatCompletionRequest]:
    """Parse and validate a request body: the engine's request and the decoded body (its chat-only fields,
    ``stream_options``, are the chat codec's). Raises RequestError subclasses."""
    req, has_unknown = decode_chat_request(body)
    chat = chat_request_from(req, limits)
    if has_unknown:
        warn_unknown_fields(body)
    return chat, req


def decode_chat_request(body: bytes) -> tuple[ChatCompletionRequest, bool]:
    """Decode a chat request body (not yet validated), and whether it holds fields this server does not
    know (``warn_unknown_fields``). Raises InvalidRequest.

    Why two decoders: finding the ignored (unknown) fields to log them takes a second pass over the
    body, ~90 us for a 1024 px photo's data URL, a tenth of a cache hit's frontend time. A body
    without them, which is what clients send unless told otherwise, decodes once with the type that
    refuses them; any failure of that pass decodes again with the lenient type, whose errors are the
    ones reported, and then reads the keys for the warning.
    """
    try:
        req, has_unknown = _exact_decoder.decode(body), False
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):  # ValidationError is a DecodeError
        req, has_unknown = decode_body(_decoder, body), True
    return req, has_unknown


_KNOWN_FIELDS = frozenset(ChatCompletionRequest.__struct_fields__)
_keys_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])
_warned: set[str] = set()
_MAX_WARNED = 64  # a client inventing names cannot grow the set (or the log) without bound
log = logging.getLogger("shmgate.gateway.intake")


def warn_unknown_fields(body: bytes) -> None:
    """Log a warning, once per field name and process, for each top-level field this server does not know.

    Why: such a field is ignored (OpenAI's forward-compatibility rule), and an operator should be able
    to see which client features are silently absent. The values are not decoded (``msgspec.Raw``).
    """
    if len(_warned) >= _MAX_WARNED:
        return
    try:
        keys = _keys_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):  # the typed decode above already accepted it
        return
    for name in keys.keys() - _KNOWN_FIELDS:
        if name not in _warned and len(_warned) < _MAX_WARNED:
            _warned.add(name)
            log.warning("request field %r is not known to this server and is ignored (logged once)", name[:64])


def decode_body(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    """``decoder.decode(body)``, every failure an InvalidRequest naming the field where msgspec says."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request: {exc}", param=_param_of(exc)) from None
    except msgspec.DecodeError:
        raise InvalidRequest("the request body is not valid JSON") from None
    except UnicodeDecodeError:  # msgspec lets invalid UTF-8 inside a string out as this, not DecodeError
        raise InvalidRequest("the request body is not valid UTF-8 JSON") from None
    except RecursionError:  # msgspec's own depth guard, also hit while skipping unknown fields
        raise InvalidRequest("the request body nests arrays or objects too deeply") from None


def chat_request_from(
    req: ChatCompletionRequest, limits: IntakeLimits, names: FieldNames = CHAT_NAMES
) -> GenerationRequest:
    """Validate a decoded chat request (messages, images, sampling). Raises RequestError subclasses
    naming the field as ``names`` say the endpoint calls it."""
    if not req.messages:
        raise InvalidRequest(f"{names.messages} must not be empty", param=names.messages)
    if len(req.messages) > limits.max_messages:
        raise InvalidRequest(f"at most {limits.max_messages} messages are accepted", param=names.messages)
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise InvalidRequest(f"n must be between 1 and {MAX_N}", param="n")
    try:
        check_unsupported(req)
        params = _sampling(req)
    except RequestError as exc:
        exc.param = None if exc.param is None else names.top(exc.param)
        raise
    tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)  # its errors name tools[i]...
    messages: list[dict[str, Any]] = []
    images: list[bytes | EncodedImage] = []
    image_params: list[str] = []
    details: list[str | None] = []
    texts: list[str] = []
    pending: list[PendingImageURL] = []
    n_chars = n_parts = 0
    for i, message in enumerate(req.messages):
        content = message.content
        parts: list[dict[str, Any]] = []
        if isinstance(content, str) or content is None:
            parts.append({"type": "text", "text": content or ""})
            n_chars += len(content or "")
            if message.role == "user":
                texts.append(content or "")
        else:
            for j, part in enumerate(content):
                n_parts += 1
                if isinstance(part, TextPart):
                    parts.append({"type": "text", "text": part.text})
                    n_chars += len(part.text)
                    if message.role == "user":
                        texts.append(part.text)
                else:
                    if len(images) >= limits.max_images:
                        raise TooManyImages(f"at most {limits.max_images} images per request", param=names.part(i))
                    if isinstance(part, VideoPart):  # a video rides as an image marked VIDEO_DETAIL
                        param = names.part(i, j, names.video)
                        add_image(
                            part.video_url.url, param, limits, images, image_params, pending, ACCEPTED_VIDEO_TYPES
                        )
                        details.append(VIDEO_DETAIL)
                        parts.append({"type": "video"})
                        continue
                    add_image(
                        part.image_url.url,
                        names.part(i, j, names.image),
                        limits,
                        images,
                        image_params,
                        pending,
                    )
                    if part.image_url.detail not in (None, "auto", "low", "high"):
                        raise InvalidRequest(
                            'detail must be "auto", "low" or "high"',
                            param=names.part(i, j, names.detail),
                        )
                    details.append(part.image_url.detail)
                    parts.append({"type": "image"})
        if n_parts > limits.max_parts:
            raise InvalidRequest(f"at most {limits.max_parts} content parts are accepted", param=names.messages)
        if n_chars > limits.max_text_chars:
            raise InvalidRequest(f"the text is longer than {limits.max_text_chars} characters", param=names.messages)
        if message.tool_calls or message.role == "tool":
            messages.append(_tool_message(f"{names.messages}[{i}]", message, parts))
            continue
        messages.append({"role": message.role, "content": parts})
    return GenerationRequest(
        model=req.model,
        messages=messages,
        images=images,
        image_params=image_params,
        params=params,
        stream=bool(req.stream),
        text="\n".join(texts),
        pending_urls=pending,
        n=req.n or 1,
        image_details=details,
        processor_kwargs=req.mm_processor_kwargs,
        tools=tools,
    )


def _tool_message(where: str, message: Message, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """An assistant message with calls, or a tool result, in the chat templates' form (text content;
    each call's arguments an object, as templates write them with ``tojson``). Raises InvalidRequest."""
    if any(part["type"] != "text" for part in parts):
        raise InvalidRequest("tool calls and tool results carry text only", param=f"{where}.content")
    text = "".join(part["text"] for part in parts)
    if message.role == "tool":
        if not message.tool_call_id:
            raise InvalidRequest("a tool message needs the tool_call_id it answers", param=f"{where}.tool_call_id")
        return {"role": "tool", "content": text, "tool_call_id": message.tool_call_id}
    if message.role != "assistant":
        raise InvalidRequest("only assistant messages carry tool_calls", param=f"{where}.tool_calls")
    calls = []
    for j, call in enumerate(message.tool_calls or []):
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise InvalidRequest(
                "a call's arguments are a JSON object, as text",
                param=f"{where}.tool_calls[{j}].function.arguments",
            )
        calls.append(
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
        )
    return {"role": "assistant", "content": text, "tool_calls": calls}


def _sampling(req: ChatCompletionRequest) -> SamplingParams:
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is not None and not 1 <= max_tokens <= 1 << 20:
        raise InvalidRequest(f"max_tokens must be between 1 and {1 << 20}", param="max_tokens")
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise InvalidRequest("temperature must be between 0 and 2", param="temperature")
    if temperature < MIN_TEMPERATURE:  # greedy, as 0 is: smaller would overflow float32 logits
        temperature = 0.0
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest("top_p must be in (0, 1]", param="top_p")
    stop: tuple[str, ...] = ()
    if isinstance(req.stop, str):
        stop = (req.stop,)
    elif req.stop:
        stop = tuple(req.stop)
    if len(stop) > 4 or any(not s or len(s) > 256 for s in stop):
        raise InvalidRequest("stop takes up to 4 non-empty strings", param="stop")
    seed = req.seed
    if seed is not None and not -(1 << 63) <= seed < 1 << 63:
        raise InvalidRequest("seed is out of range", param="seed")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=stop,
        presence_penalty=_penalty(req.presence_penalty, "presence_penalty"),
        frequency_penalty=_penalty(req.frequency_penalty, "frequency_penalty"),
        logit_bias=_logit_bias(req.logit_bias),
        stop_token_ids=_stop_token_ids(req.stop_token_ids),
        logprobs=(req.top_logprobs or 0) if req.logprobs else -1,
        grammar=grammar_for(req.response_format),
    )


def check_unsupported(req: ChatCompletionRequest) -> None:
    """Refuse, with a 400 naming the field, what no model here does: legacy functions, other modalities.

    Why refuse rather than ignore: a client that asks for a JSON object or a tool call and gets
    free text back fails later and further from the cause.
    """
    if req.functions:
        raise InvalidRequest(
            "functions (the legacy form of function calling) are not supported; send tools", param="functions"
        )
    if req.function_call is not None and req.function_call != "none":
        raise InvalidRequest(
            "function_call (the legacy form of tool_choice) is not supported; send tool_choice", param="function_call"
        )
    for name, feature in FORM_FIELDS.items():
        if getattr(req, name) is not None:
            raise InvalidRequest(
                f"Unrecognized request argument supplied: {name} ({feature})",
                param=name,
            )
    if req.modalities is not None and req.modalities != ["text"]:
        raise InvalidRequest('only modalities ["text"] is supported', param="modalities")
    if req.echo is not None and req.echo is not False:
        raise InvalidRequest("echo is not supported; only false is accepted", param="echo")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")


def _penalty(value: float | None, name: str) -> float:
    if value is None:
        return 0.0
    if not -2.0 <= value <= 2.0:
        raise InvalidRequest(f"{name} must be between -2 and 2", param=name)
    return float(value)


MAX_LOGIT_BIAS = 300  # OpenAI's own bound on the number of entries


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}`` -> sorted ``((id, bias), ...)``; the vocabulary bound is checked per model."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 9:  # isdigit alone admits "²", which int() refuses
            raise InvalidRequest(f"logit_bias keys are token ids; {key[:20]!r} is not", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise InvalidRequest("logit_bias values must be between -100 and 100", param="logit_bias")
        out[int(key)] = float(value)
    return tuple(sorted(out.items()))


def _stop_token_ids(ids: list[int] | None) -> tuple[int, ...]:
    if not ids:
        return ()
    if len(ids) > 64 or any(not 0 <= i < 1 << 31 for i in ids):
        raise InvalidRequest("stop_token_ids takes up to 64 token ids", param="stop_token_ids")
    return tuple(sorted(set(ids)))


def add_image(
    url: str,
    param: str,
    limits: IntakeLimits,
    images: list[bytes | EncodedImage],
    params: list[str],
    pending: list[PendingImageURL],
    types: tuple[str, ...] = ACCEPTED_IMAGE_TYPES,
) -> None:
    """Append an image given by URL: a data URL's (checked) text, or, when fetching is allowed, a
    placeholder and its PendingImageURL. Raises RequestError subclasses naming ``param``."""
    if limits.allow_image_urls and url[:8].lower().startswith(("http://", "https://")):
        pending.append(PendingImageURL(len(images), url, param))
        images.append(b"")
    else:
        images.append(data_url_image(url, limits, param, types))
    params.append(param)


def data_url_image(
    url: str, limits: IntakeLimits, param: str, types: tuple[str, ...] = ACCEPTED_IMAGE_TYPES
) -> EncodedImage:
    """A data URL's image, checked (prefix, type, size bound). Raises RequestError subclasses naming ``param``."""
    if url[:8].lower().startswith(("http://", "https://")):
        raise InvalidRequest(
            "image URLs are not fetched by this server unless its operator starts it with --allow-image-urls; "
            "send the image inline as a data URL (data:image/jpeg;base64,...)",
            param=param,
        )
    match = _DATA_URL.match(url[:256])
    if not match:
        raise InvalidRequest("image_url must be a data URL (data:image/jpeg;base64,...)", param=param)
    mime = (match.group(1) or "").lower()
    if mime not in types:
        raise UndecodableImage(f"unsupported type {mime[:40]!r}; send one of {', '.join(types)}", param=param)
    if not match.group(3):
        raise InvalidRequest("image data URLs must be base64-encoded", param=param)
    payload = url[match.end() :]
    if len(payload) > (limits.max_image_bytes * 4) // 3 + 1024:
        raise ImageTooLarge(f"the image is larger than {limits.max_image_bytes} bytes", param=param)
    if not payload or payload.isspace():
        raise UndecodableImage("the image is empty", param=param)
    return EncodedImage(payload, limits.max_image_bytes)


def _param_of(exc: msgspec.ValidationError) -> str | None:
    match = re.search(r"at `\$\.?([^`]*)`", str(exc))
    return match.group(1) if match else None
