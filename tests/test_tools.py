"""Tool calling through the OpenAI client against a real ``shmgate serve`` of a tiny random Qwen2.5-VL.

The model's weights are random: it never calls a function by itself. What makes its calls parse is the
grammar (gateway/tools.py): ``required`` and a named function force a call from the first token, and
``auto`` forces one once its opening tag is written (a ``logit_bias`` on the tag's token makes the
random model write it). Every call's arguments are checked against the function's schema with
jsonschema. The checkpoint's tokenizer carries ``<tool_call>`` and ``</tool_call>`` as added tokens, as
Qwen2.5-VL's real one does; its chat template has no tool section (as Qwen2.5-VL's has none), so the
tools are written in the family's hermes format (gateway/tool_prompt.py). One server serves the module.
"""

from __future__ import annotations

import io
import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from shmgate.gateway.tool_output import split_output
from shmgate.gateway.tool_prompt import ToolPrompt, reads_tools, write_tools
from shmgate.gateway.tools import parse_tools, tool_grammar
from shmgate.shared.errors import InvalidRequest
from shmgate.shared.families.tool_formats import HERMES, tool_format
from tests.serving import IMAGES, Server, data_url, start_server, stop_and_check

pytest.importorskip("llguidance")
pytest.importorskip("transformers")

VLM = "tiny-qwen2-5-vl-tools"
CLASSIFIER = "efficientnet-lite0"
PHOTO = data_url((IMAGES / "chelsea_640.jpg").read_bytes())

# Bounded strings and numbers: inside an unbounded string a random model may never close it.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLICK = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 999},
        "y": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["x", "y"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "click", "description": "Click on the screen.", "parameters": CLICK, "strict": True},
    },
]
SCHEMAS = {"get_weather": WEATHER, "click": CLICK}


def with_tool_tokens(source: Path, target: Path) -> Path:
    """A copy of the tiny checkpoint whose tokenizer has ``<tool_call>`` and ``</tool_call>`` (added, not
    special, as in Qwen2.5-VL's tokenizer) and whose embeddings have rows for them."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    shutil.copytree(source, target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.save_pretrained(target)
    model = AutoModelForImageTextToText.from_pretrained(target)
    torch.manual_seed(0)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def model_dir(tiny_vlm: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_tool_tokens(tiny_vlm("qwen2_5_vl"), tmp_path_factory.mktemp("models") / VLM)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        f"hf:{model_dir}",
        tmp_path_factory.mktemp("serve"),
        "--model",
        CLASSIFIER,
        "--workers",
        "1",
        "--frontends",
        "1",
        "--threads",
        "1",
        "--queue-depth",
        "8",
        "--batch-dir",
        str(tmp_path_factory.mktemp("batches")),
    )
    try:
        yield server
    finally:
        stop_and_check(server)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def tag_bias(model_dir: Path, *, between: bool = False) -> dict[str, int]:
    """A logit_bias that makes the random model open a call (then the grammar writes the call);
    ``between``: and open another after each (the newline between calls)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    bias = {str(tokenizer.convert_tokens_to_ids("<tool_call>")): 100}
    if between:
        bias.update({str(i): 100 for i in tokenizer.encode("\n")})
    return bias


def _messages(text: str = "What is the weather in Paris?") -> list[Any]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": PHOTO, "detail": "low"}},
                {"type": "text", "text": text},
            ],
        }
    ]


def check_call(name: str, arguments: str, allowed: set[str] | None = None) -> dict[str, Any]:
    assert name in (allowed or SCHEMAS)
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, SCHEMAS[name])
    return parsed


# -- units: parsing, the grammar, the prompt, the reader ------------------------------------------


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "tools[0].function.parameters"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            None,
            "tools[0].function.parameters",
        ),
        ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None, "tools[0].function.strict"),
        ([{"type": "function", "function": {"name": "f", "description": 3}}], None, "tools[0].function.description"),
        (
            [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
            None,
            "tools[1].function.name",
        ),
        ([{"type": "web_search"}], None, "tools[0].type"),
        ([{"type": "function"}], None, "tools[0].function"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
    ],
)
def test_a_malformed_tool_or_choice_is_a_400_naming_it(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_tools(tools, choice, None)
    assert refused.value.param == param


def test_a_schema_the_compiler_refuses_names_its_function() -> None:
    tools = [
        TOOLS[0],
        {
            "type": "function",
            "function": {"name": "bad", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
        },
    ]
    calling = parse_tools(tools, "auto", None)
    assert calling is not None
    with pytest.raises(InvalidRequest) as refused:
        tool_grammar(calling, HERMES)
    assert refused.value.param == "tools[1].function.parameters" and "'bad'" in refused.value.message


def test_none_renders_no_tools_and_a_template_with_a_tool_section_is_told_apart() -> None:
    assert parse_tools(TOOLS, "none", None) is None
    assert reads_tools("{% for t in tools %}{{ t }}{% endfor %}") and not reads_tools("{{ messages }}")
    assert tool_format("qwen2_5_vl").default_system == "You are a helpful assistant."


def test_the_hermes_prompt_carries_the_tools_the_calls_and_the_results() -> None:
    calling = parse_tools(TOOLS, "auto", None)
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}},
                }
            ],
        },
        {"role": "tool", "content": "12 degrees", "tool_call_id": "call_1"},
        {"role": "tool", "content": "rain", "tool_call_id": "call_2"},
    ]
    messages, args = write_tools(history, calling, ToolPrompt(tool_format("qwen2_vl"), native=False))
    assert args == {} and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"][0]["text"]
    assert system.startswith("You are a helpful assistant.\n\n# Tools") and '"name": "click"' in system
    assert (
        messages[2]["content"][0]["text"]
        == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    )
    assert (
        messages[3]["content"][0]["text"]
        == "<tool_response>\n12 degrees\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
    )
    native, args = write_tools(history, calling, ToolPrompt(HERMES, native=True))
    assert native == history and [t["function"]["name"] for t in args["tools"]] == ["get_weather", "click"]


def test_the_reader_splits_text_and_calls_whatever_the_pieces() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "click", "arguments": {"x": 1, "y": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "}\\n</tool_call>", "unit": "celsius"}}\n</tool_call>'
    content, calls = split_output(text, HERMES)
    assert content == "Let me look.\n" and [c.name for c in calls] == ["click", "get_weather"]
    assert json.loads(calls[1].arguments)["city"] == "}\n</tool_call>"
    assert split_output("no <tool_call but text", HERMES) == ("no <tool_call but text", [])


# A template with a tool section, as Qwen2.5's text models ship: the definitions in a system turn, the
# calls in hermes blocks (what an operator's --tool-chat-template file holds).
NATIVE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% else %}{% for c in message.content %}"
    "{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif c.type == 'text' %}{{ c.text }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{% for tc in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_an_operator_template_renders_the_tools_itself(model_dir: Path) -> None:
    """--tool-chat-template's text (AppOptions -> get_preprocessor) replaces the checkpoint's template."""
    from shmgate.gateway.preprocess import get_preprocessor

    default = get_preprocessor(f"hf:{model_dir}").tool_prompt()
    assert default is not None and not default.native and default.tags_are_tokens
    pre = get_preprocessor(f"hf:{model_dir}", tool_chat_template=NATIVE_TEMPLATE)
    prompt = pre.tool_prompt()
    assert prompt is not None and prompt.native and prompt.template == NATIVE_TEMPLATE
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "click", "arguments": {"x": 1, "y": 2}}}
            ],
        },
    ]
    messages, args = write_tools(history, parse_tools(TOOLS, "auto", None), prompt)
    text = pre.build_prompt(messages, [], **args).text
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>") and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "click", "arguments": {"x": 1, "y": 2}}\n</tool_call>' in text


# One family per kind of chat template (the others share one of these: Qwen3-VL and InternVL Qwen2-VL's,
# SmolVLM2 Idefics3's, LLaVA-NeXT LLaVA's); Qwen2.5-VL's checkpoint is the server's, built anyway.
TEMPLATE_KINDS = ["qwen2_5_vl", "llava", "idefics3", "gemma3", "paligemma"]


@pytest.mark.parametrize("family", TEMPLATE_KINDS)
def test_every_family_renders_tools_and_its_grammar_writes_calls_that_parse(
    tiny_vlm: Callable[[str], Path], family: str
) -> None:
    """The family's prompt takes its tool format, and its tokenizer under the grammar (llguidance's
    matcher walking random allowed tokens, as a random model would) writes calls the reader parses."""
    import random

    import llguidance
    import llguidance.hf
    import numpy as np
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    from shmgate.gateway.preprocess.hf import HFPreprocessor

    pre = HFPreprocessor(tiny_vlm(family))
    prompt = pre.tool_prompt()
    assert prompt is not None and not prompt.native
    calling = parse_tools(TOOLS, "required", None)
    assert calling is not None
    messages, args = write_tools([{"role": "user", "content": [{"type": "text", "text": "Weather?"}]}], calling, prompt)
    assert '"get_weather"' in pre.build_prompt(messages, [], **args).text
    tokenizer = llguidance.hf.from_tokenizer(pre.tokenizer)
    matcher = llguidance.LLMatcher(
        tokenizer, tool_grammar(calling, prompt.format, tags_are_tokens=prompt.tags_are_tokens)
    )
    mask, rng, ids = allocate_token_bitmask(1, tokenizer.vocab_size), random.Random(family), []
    while not matcher.is_stopped() and len(ids) < 400:
        fill_next_token_bitmask(matcher, mask)
        allowed = np.flatnonzero(np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[: tokenizer.vocab_size])
        ids.append(int(rng.choice(list(allowed))))
        assert matcher.consume_token(ids[-1]), matcher.get_error()
    content, calls = split_output(pre.tokenizer.decode(ids, skip_special_tokens=True), prompt.format)
    assert calls and not content.strip(), (content, calls)
    for call in calls:
        check_call(call.name, call.arguments)


# -- through the server ---------------------------------------------------------------------------


def test_required_forces_calls_that_validate(client: openai.OpenAI) -> None:
    for seed in range(3):
        done = client.chat.completions.create(
            model=VLM,
            messages=_messages(),
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=80,
            temperature=1.0,
            seed=seed,
        )
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            check_call(call.function.name, call.function.arguments)
        assert done.usage is not None and done.usage.completion_tokens > 5


def test_a_named_function_is_the_one_call(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(
        model=VLM,
        messages=_messages("Click the cat."),
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "click"}},
        max_tokens=60,
        temperature=0,
    )
    calls = done.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1 and calls[0].function.name == "click"
    check_call("click", calls[0].function.arguments)
    assert done.choices[0].finish_reason == "tool_calls"


def test_a_streamed_call_is_assembled_by_the_sdk(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model=VLM,
        messages=_messages(),
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=1.0,
        seed=5,
        stream_options={"include_usage": True},
    ) as stream:
        events = list(stream)
        kinds = [event.type for event in events]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds
    assert all(not event.delta for event in events if event.type == "content.delta")
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call.function.name, call.function.arguments)
    assert final.usage is not None and final.usage.completion_tokens > 5


def test_a_stream_opens_each_call_with_its_index_id_and_name(server: Server) -> None:
    body = {
        "model": VLM,
        "messages": _messages(),
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 120,
        "seed": 7,
        "stream": True,
    }
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    opened = [c for c in calls if "id" in c]
    assert opened and opened[0] == {
        "index": 0,
        "id": opened[0]["id"],
        "type": "function",
        "function": {"name": opened[0]["function"]["name"], "arguments": ""},
    }
    assert [c["index"] for c in opened] == list(range(len(opened)))
    for c in opened:
        text = "".join(d["function"]["arguments"] for d in calls if d["index"] == c["index"])
        check_call(c["function"]["name"], text)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_writes_text_or_a_call_forced_once_opened(client: openai.OpenAI, model_dir: Path) -> None:
    free = client.chat.completions.create(model=VLM, messages=_messages(), tools=TOOLS, max_tokens=12, temperature=0)
    assert free.choices[0].message.content and not free.choices[0].message.tool_calls  # random text
    bias = tag_bias(model_dir)
    for stream in (False, True):
        base: dict[str, Any] = dict(
            model=VLM,
            messages=_messages(),
            tools=TOOLS,
            tool_choice="auto",
            parallel_tool_calls=False,
            logit_bias=bias,
            max_tokens=80,
            temperature=0,
        )
        if stream:
            with client.chat.completions.stream(**base) as events:
                done = events.get_final_completion()
        else:
            done = client.chat.completions.create(**base)
        choice = done.choices[0]
        assert (
            choice.finish_reason == "tool_calls" and choice.message.tool_calls and len(choice.message.tool_calls) == 1
        )
        check_call(choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments)


def test_a_tool_result_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=VLM,
        messages=_messages(),
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    history = [
        *_messages(),
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 12})},
    ]
    second = client.chat.completions.create(model=VLM, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert second.choices[0].message.content and second.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20  # type: ignore[union-attr]  # the call and the result
    # the history alone (no tools offered now) still renders the call and its result
    third = client.chat.completions.create(model=VLM, messages=history, max_tokens=4, temperature=0)
    assert third.usage is not None and third.usage.prompt_tokens < second.usage.prompt_tokens


def test_parallel_calls_are_numbered_and_each_validates(client: openai.OpenAI, model_dir: Path) -> None:
    # the tag's bias makes every call open another until max_tokens: the last one is cut
    done = client.chat.completions.create(
        model=VLM,
        messages=_messages(),
        tools=TOOLS,
        tool_choice="required",
        logit_bias=tag_bias(model_dir, between=True),
        max_tokens=240,
        temperature=0,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls and len(choice.message.tool_calls) >= 2
    for call in choice.message.tool_calls[:-1]:
        check_call(call.function.name, call.function.arguments)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"model": CLASSIFIER}, "tools"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(server: Server, change: dict[str, Any], param: str) -> None:
    body = {"model": VLM, "messages": _messages(), "tools": TOOLS, "max_tokens": 4, **change}
    reply = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    if change.get("model") == CLASSIFIER:
        assert CLASSIFIER in error["message"]


# -- the Responses API -----------------------------------------------------------------------------

FLAT_TOOLS: list[Any] = [{"type": "function", **tool["function"]} for tool in TOOLS]


def _input(text: str = "What is the weather in Paris?") -> list[Any]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "input_image", "image_url": PHOTO, "detail": "low"},
                {"type": "input_text", "text": text},
            ],
        }
    ]


def test_responses_answer_with_function_call_items(client: openai.OpenAI) -> None:
    done = client.responses.create(
        model=VLM,
        input=_input(),
        tools=FLAT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        temperature=0,
    )
    assert done.status == "completed" and [item.type for item in done.output] == ["function_call"]
    call = done.output[0]
    assert call.type == "function_call" and call.call_id.startswith("call_") and call.status == "completed"
    check_call(call.name, call.arguments)
    assert [t.name for t in done.tools] == ["get_weather", "click"]  # type: ignore[union-attr]
    named = client.responses.create(
        model=VLM,
        input=_input(),
        tools=FLAT_TOOLS,
        tool_choice={"type": "function", "name": "click"},
        max_output_tokens=60,
    )
    assert [(i.type, i.name) for i in named.output] == [("function_call", "click")]  # type: ignore[union-attr]
    # the call and its output sent back: the next answer reads them
    follow = client.responses.create(
        model=VLM,
        input=[
            *_input(),
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "12 degrees"},
        ],
        tools=FLAT_TOOLS,
        max_output_tokens=6,
        temperature=0,
    )
    assert follow.output[0].type == "message" and follow.usage is not None
    assert follow.usage.input_tokens > done.usage.input_tokens + 10  # type: ignore[union-attr]


def test_a_responses_stream_carries_the_call_events(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=VLM,
        input=_input(),
        tools=FLAT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-4:] == [
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "response.content_part.added" not in kinds  # no text: no message
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    call = final.output[0]
    assert call.type == "function_call" and call.arguments == deltas == done.arguments  # type: ignore[union-attr]
    check_call(call.name, call.arguments)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_responses_built_in_tool_or_a_bad_item_is_a_400_naming_it(server: Server) -> None:
    url = server.base_url + "/v1/responses"
    for extra, param in [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools[0].parameters"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0]"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x", "extra": 1}]}, "input[0].extra"),
        ({"input": [{"type": "reasoning"}]}, "input[0].type"),
    ]:
        reply = httpx.post(url, json={"model": VLM, "input": "hi", "max_output_tokens": 2, **extra}, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, (extra, reply.text)


# -- the Batch API ---------------------------------------------------------------------------------


def test_a_batch_line_with_tools_answers_with_calls(client: openai.OpenAI) -> None:
    line = {
        "custom_id": "tools-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": VLM,
            "messages": _messages(),
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 80,
        },
    }
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode() + b"\n")), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.output_file_id, batch
    output = json.loads(client.files.content(batch.output_file_id).text)
    message = output["response"]["body"]["choices"][0]["message"]
    assert output["response"]["body"]["choices"][0]["finish_reason"] == "tool_calls"
    for call in message["tool_calls"]:
        check_call(call["function"]["name"], call["function"]["arguments"])


def test_a_large_toolset_rides_in_the_arena(client: openai.OpenAI) -> None:
    """Ten functions: a grammar of ~4 KiB, over what a request descriptor carries inline (more would not
    fit the tiny model's 4,096-token context, its byte-level vocabulary spelling the definitions out)."""
    many = [
        {
            "type": "function",
            "function": {
                "name": f"action_{i}",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 4096},
                        "mode": {"enum": ["left", "right", "double"]},
                        "note": {"type": "string", "maxLength": 8},
                    },
                    "required": ["x", "mode"],
                    "additionalProperties": False,
                },
            },
        }
        for i in range(10)
    ]
    done = client.chat.completions.create(
        model=VLM,
        messages=[{"role": "user", "content": "Act."}],
        tools=many,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
    )
    (call,) = done.choices[0].message.tool_calls or []
    schema = many[int(call.function.name.removeprefix("action_"))]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
