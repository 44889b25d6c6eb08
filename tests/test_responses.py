"""``POST /v1/responses`` through the OpenAI client, against a real ``shmgate serve`` of the tiny random
Qwen2-VL and the default classifier (gateway/responses.py over the pipeline of gateway/pipeline.py).

The tiny model's weights are random: its text is noise, so what is checked is the shape the client
parses, the event order, the counts, and JSON that only the grammar can make.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from shmgate.gateway.openapi import openapi_document
from shmgate.gateway.stages import parse_server_timing
from tests.serving import IMAGES, Server, data_url

pytest.importorskip("llguidance")

VLM = "tiny-qwen2-vl"
CLASSIFIER = "efficientnet-lite0"
PHOTO = data_url((IMAGES / "chelsea_640.jpg").read_bytes())
PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog", "bird"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}


class Pet(pydantic.BaseModel):
    name: Annotated[str, pydantic.Field(max_length=12)]
    kind: Literal["cat", "dog", "bird"]


PET_FORMAT = {"type": "json_schema", "name": "pet", "schema": PET_SCHEMA, "strict": True}


@pytest.fixture
def server(tiny_qwen2_vl_server: Server) -> Server:
    """The tiny Qwen2-VL and classifier server this file shares with the others of its group (tests/conftest.py)."""
    return tiny_qwen2_vl_server


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _input(text: str = "What is in the picture?") -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "input_image", "image_url": PHOTO, "detail": "low"},
                {"type": "input_text", "text": text},
            ],
        }
    ]


def test_a_whole_response_has_the_shape_and_counts_the_client_reads(client: openai.OpenAI) -> None:
    # the grammar ends the answer (random weights alone rarely sample the end of text)
    done = client.responses.create(
        model=VLM,
        input=_input(),
        instructions="Be brief.",
        text={"format": PET_FORMAT},  # type: ignore[typeddict-item]
        max_output_tokens=80,
        temperature=0,
        metadata={"k": "v"},
    )
    assert done.object == "response" and done.id.startswith("resp_") and done.model == VLM
    assert done.status == "completed" and done.incomplete_details is None and done.error is None
    assert done.instructions == "Be brief." and done.metadata == {"k": "v"} and done.store is False
    assert [item.type for item in done.output] == ["message"]
    assert done.output_text == done.output[0].content[0].text  # type: ignore[union-attr]
    assert done.usage is not None and done.usage.input_tokens > 24  # the image's tokens and the text
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    cut = client.responses.create(model=VLM, input="Tell me a long story.", max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage is not None and cut.usage.output_tokens == 3 and cut.output[0].status == "incomplete"  # type: ignore[union-attr]


# Every field the Open Responses specification requires of a response object (its ResponseResource)
OPEN_RESPONSES_REQUIRED = (
    "id object created_at completed_at status incomplete_details model previous_response_id instructions output "
    "error tools tool_choice truncation parallel_tool_calls text top_p presence_penalty frequency_penalty "
    "top_logprobs temperature reasoning user usage max_output_tokens max_tool_calls store background "
    "service_tier metadata safety_identifier prompt_cache_key"
).split()
# and the types of those it requires as numbers, integers and booleans (never null)
OPEN_RESPONSES_TYPES = {
    "type": "object",
    "required": OPEN_RESPONSES_REQUIRED,
    "properties": {
        **{name: {"type": "number"} for name in ("top_p", "temperature", "presence_penalty", "frequency_penalty")},
        **{name: {"type": "boolean"} for name in ("parallel_tool_calls", "store", "background")},
        "created_at": {"type": "integer"},
        "completed_at": {"type": ["integer", "null"]},
        "top_logprobs": {"type": "integer"},
        "tools": {"type": "array"},
        "truncation": {"enum": ["auto", "disabled"]},
        "output": {
            "type": "array",
            "items": {
                "properties": {
                    "content": {
                        "type": "array",
                        "items": {"required": ["type", "text", "annotations", "logprobs"]},
                    }
                }
            },
        },
    },
}


def test_a_response_carries_every_field_open_responses_requires(server: Server) -> None:
    body = {
        "model": VLM,
        "input": "Tell me a long story.",
        "max_output_tokens": 3,
        "temperature": 0,  # greedy: this prompt's first tokens are not the end of the text (a sampled one could be)
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
    }
    whole = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60).json()
    jsonschema.validate(whole, OPEN_RESPONSES_TYPES)
    assert (whole["presence_penalty"], whole["frequency_penalty"], whole["top_logprobs"]) == (0.5, 0.25, 0)
    assert whole["status"] == "incomplete" and whole["completed_at"] is None  # cut by max_output_tokens
    done = httpx.post(
        server.base_url + "/v1/responses",
        json={"model": VLM, "input": "hi", "text": {"format": PET_FORMAT}, "max_output_tokens": 80, "temperature": 0},
        timeout=60,
    ).json()
    assert done["status"] == "completed" and done["completed_at"] >= done["created_at"]
    with httpx.stream("POST", server.base_url + "/v1/responses", json={**body, "stream": True}, timeout=60) as events:
        frames = [frame for frame in events.read().decode().split("\n\n") if frame]
    assert frames[-1] == "data: [DONE]"  # the terminal event of an Open Responses stream
    for frame in frames[:-1]:  # each event names its type twice, as the specification asks
        kind, data = frame.split("\n")
        assert json.loads(data.removeprefix("data: "))["type"] == kind.removeprefix("event: ")
    final = json.loads(frames[-2].split("\n")[1].removeprefix("data: "))["response"]
    jsonschema.validate(final, OPEN_RESPONSES_TYPES)
    assert final["presence_penalty"] == 0.5


def test_top_logprobs_return_each_tokens_log_probability_whole_and_streamed(client: openai.OpenAI) -> None:
    base: dict[str, Any] = dict(model=VLM, input="hi", max_output_tokens=5, temperature=0, top_logprobs=2)
    whole = client.responses.create(**base)
    part = whole.output[0].content[0]  # type: ignore[union-attr]
    assert whole.top_logprobs == 2 and whole.usage is not None
    assert part.logprobs is not None and len(part.logprobs) == whole.usage.output_tokens == 5
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in part.logprobs)
    streamed = []
    for event in client.responses.create(**base, stream=True):
        if event.type == "response.output_text.delta":
            streamed.extend(event.logprobs)
        last = event
    assert last.type == "response.incomplete"  # cut by max_output_tokens, as the whole one was
    final_part = last.response.output[0].content[0]  # type: ignore[union-attr]
    assert (
        [e.token for e in streamed] == [e.token for e in final_part.logprobs or []] == [e.token for e in part.logprobs]
    )
    included = client.responses.create(
        model=VLM, input="hi", max_output_tokens=3, temperature=0, include=["message.output_text.logprobs"]
    )
    assert len(included.output[0].content[0].logprobs or []) == 3  # type: ignore[union-attr]


def test_a_stream_is_the_event_sequence_the_sdk_accumulates(client: openai.OpenAI) -> None:
    base: dict[str, Any] = dict(
        model=VLM, input=_input(), text={"format": PET_FORMAT}, max_output_tokens=80, temperature=0
    )
    whole = client.responses.create(**base)
    kinds = []
    with client.responses.stream(**base) as stream:
        for event in stream:
            kinds.append((event.type, event.sequence_number))
        streamed = stream.get_final_response()
    types = [kind for kind, _ in kinds]
    assert [n for _, n in kinds] == list(range(len(kinds)))
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[:4] == head and types[-4:-1] == tail and types[-1] == "response.completed"
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert streamed.output_text == whole.output_text and streamed.usage == whole.usage
    jsonschema.validate(json.loads(streamed.output_text), PET_SCHEMA)


def test_text_format_json_schema_and_json_object_parse_whole_and_streamed(client: openai.OpenAI) -> None:
    sampled = client.responses.create(
        model=VLM,
        input=_input("Which pet?"),
        text={"format": PET_FORMAT},
        max_output_tokens=80,
        temperature=1.0,  # type: ignore[typeddict-item]
    )
    assert sampled.status == "completed"
    jsonschema.validate(json.loads(sampled.output_text), PET_SCHEMA)
    deltas = []
    events = client.responses.create(
        model=VLM,
        input=_input("Answer in JSON."),
        text={"format": {"type": "json_object"}},
        max_output_tokens=120,
        temperature=0,
        stream=True,
    )
    for event in events:
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        last = event
    assert "".join(deltas).startswith("{")
    if last.type == "response.completed":
        assert isinstance(json.loads("".join(deltas)), dict)
    parsed = client.responses.parse(model=VLM, input=_input("Which pet?"), text_format=Pet, max_output_tokens=80)
    assert isinstance(parsed.output_parsed, Pet)  # the client's own schema from pydantic, and its parse
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=VLM, input="x", text={"format": {"type": "json_schema", "name": "p", "schema": {"type": "strin"}}}
        )  # type: ignore[typeddict-item]
    assert refused.value.body["param"] == "text.format"  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        (
            {"text": {"format": {"type": "json_object", "schema": {}}}},
            "text.format",
        ),  # a chat field: unknown here, not ignored
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0].file_id",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.jpg"}]}
                ]
            },
            "input[0].content[0].image_url",
        ),
        ({"input": [{"role": "user", "content": "hi", "surprise": 1}]}, "input[0].surprise"),
    ],
)
def test_what_is_not_kept_or_not_supported_is_a_400_naming_it(
    server: Server, extra: dict[str, Any], param: str
) -> None:
    body = {"model": VLM, "input": "hi", **extra}
    answer = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("model", "extra", "param", "words"),
    [
        # the classifier given no image: the check runs after parsing, on the engine's request
        (CLASSIFIER, {"input": "hi"}, "input", "contains none"),
        (CLASSIFIER, {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}, "input", ""),
        (CLASSIFIER, {"input": "hi", "text": {"format": {"type": "json_object"}}}, "text.format", "text.format is"),
        (
            VLM,
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}
                ]
            },
            "input[0].content[0].image_url",
            "",
        ),
        (
            VLM,
            {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}},
            "text.format",
            "text.format.name",
        ),
        (VLM, {"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format", "text.format type"),
    ],
)
def test_an_error_names_the_field_as_this_api_calls_it(
    server: Server, model: str, extra: dict[str, Any], param: str, words: str
) -> None:
    """Errors raised after parsing (a model's checks, an image's decode) name the Responses API's
    fields, in ``param`` and in the message, never the chat form's (messages, response_format)."""
    answer = httpx.post(server.base_url + "/v1/responses", json={"model": model, **extra}, timeout=30)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == param, error
    assert words in error["message"] and "response_format" not in error["message"], error


def test_the_classifier_answers_from_its_result_cache_and_refuses_a_format(
    client: openai.OpenAI, server: Server
) -> None:
    labels = client.responses.create(model=CLASSIFIER, input=_input())
    assert labels.status == "completed" and ":" in labels.output_text  # "label: probability" lines
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=CLASSIFIER, input=_input(), text={"format": {"type": "json_object"}})
    assert refused.value.body["param"] == "text.format"  # type: ignore[index]
    # a deterministic answer comes from the result cache the second time (each frontend keeps its own:
    # one connection, one frontend), and says so in Server-Timing
    body = {"model": CLASSIFIER, "input": _input()}
    with httpx.Client(base_url=server.base_url, timeout=30) as one_connection:
        one_connection.post("/v1/responses", json=body)
        again = one_connection.post("/v1/responses", json=body)
    assert again.json()["output"][0]["content"][0]["text"] == labels.output_text
    jsonschema.validate(again.json(), openapi_document()["components"]["schemas"]["Response"])  # as documented
    timing = again.headers["server-timing"]
    assert "result_cache;desc=hit" in timing and "total" in parse_server_timing(timing)


def test_a_request_of_n_choices_is_admitted_once(server: Server) -> None:
    admitted = f'shmgate_model_requests_total{{model="{VLM}",outcome="admitted"}}'
    before = server.metric(admitted)
    body = {"model": VLM, "messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 2}
    assert httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    assert server.metric(admitted) - before == 1
