"""A tiny Qwen2-VL served by a real ``shmgate serve --model hf:<dir>``, through the OpenAI client."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from shmgate.gateway.stages import parse_server_timing
from tests.hf_fixture import no_eos_bias
from tests.serving import IMAGES, Server, data_url, noise_png, wait_until


@pytest.fixture
def hf_server(tiny_qwen2_vl_server: Server) -> Server:
    """The tiny Qwen2-VL server this file shares with the others of its group (tests/conftest.py)."""
    return tiny_qwen2_vl_server


def _messages(photo: str, text: str) -> list[dict[str, object]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url((IMAGES / photo).read_bytes())}},
                {"type": "text", "text": text},
            ],
        }
    ]


def test_streamed_tokens_equal_the_non_streamed_answer_with_the_same_seed(hf_server: Server) -> None:
    client = openai.OpenAI(base_url=hf_server.base_url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    assert model == "tiny-qwen2-vl"
    kwargs = dict(
        model=model,
        messages=_messages("chelsea_640.jpg", "Describe the photo."),
        seed=7,
        temperature=0.8,
        max_tokens=12,
    )
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)  # type: ignore[call-overload]
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(pieces) >= 2, "tokens must arrive as they are generated, not in one piece"
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens > 0


def test_max_tokens_ends_with_length_and_exact_usage(hf_server: Server) -> None:
    client = openai.OpenAI(base_url=hf_server.base_url + "/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="tiny-qwen2-vl", messages=_messages("coffee_1024.jpg", "Hi"), max_tokens=5, temperature=0
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 5


def test_concurrent_requests_with_different_images_do_not_mix(hf_server: Server) -> None:
    cases = [
        ("chelsea_1024.jpg", "What animal?"),
        ("coffee_640.jpg", "What drink?"),
        ("camera_640.jpg", "What object?"),
        ("chelsea_640.jpg", "Colour?"),
    ]
    body = lambda photo, text: {  # noqa: E731
        "model": "tiny-qwen2-vl",
        "messages": _messages(photo, text),
        "max_tokens": 8,
        "temperature": 0,
    }

    def alone(photo: str, text: str) -> str:
        r = httpx.post(hf_server.base_url + "/v1/chat/completions", json=body(photo, text), timeout=120)
        return r.json()["choices"][0]["message"]["content"]

    expected = [alone(*case) for case in cases]

    async def together() -> list[str]:
        async with httpx.AsyncClient(base_url=hf_server.base_url, timeout=120) as client:
            responses = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body(*case)) for case in cases * 2)
            )
        return [r.json()["choices"][0]["message"]["content"] for r in responses]

    assert asyncio.run(together()) == expected * 2


def test_unsupported_fields_are_a_400_naming_them_over_http(hf_server: Server) -> None:
    url = hf_server.base_url + "/v1/chat/completions"
    base = {"model": "tiny-qwen2-vl", "messages": _messages("coffee_640.jpg", "Hi"), "max_tokens": 2}
    for extra, param in [
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format",
        ),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ]:
        r = httpx.post(url, json={**base, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    assert httpx.post(url, json={**base, "some_future_field": 1}, timeout=60).status_code == 200


def test_logit_bias_is_honoured_over_http(hf_server: Server, tiny_qwen2_vl_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_vl_dir)
    favoured = tokenizer.encode(" fox")[0]
    client = openai.OpenAI(base_url=hf_server.base_url + "/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="tiny-qwen2-vl",
        messages=_messages("camera_640.jpg", "Name it."),
        max_tokens=3,
        temperature=0,
        logit_bias={str(favoured): 100},
    )
    assert reply.choices[0].message.content == tokenizer.decode([favoured] * 3) != ""


def test_logprobs_streamed_and_whole_agree(hf_server: Server) -> None:
    client = openai.OpenAI(base_url=hf_server.base_url + "/v1", api_key="unused")
    kwargs = dict(
        model="tiny-qwen2-vl",
        messages=_messages("chelsea_640.jpg", "Describe."),
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.logprob <= 0 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)  # greedy
    chunks = list(client.chat.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_n_choices_are_the_seeded_single_answers(hf_server: Server) -> None:
    client = openai.OpenAI(base_url=hf_server.base_url + "/v1", api_key="unused")
    kwargs = dict(
        model="tiny-qwen2-vl", messages=_messages("coffee_640.jpg", "Describe."), max_tokens=6, temperature=0.9
    )
    many = client.chat.completions.create(n=3, seed=40, **kwargs)  # type: ignore[call-overload]
    singles = [client.chat.completions.create(seed=40 + i, **kwargs) for i in range(3)]  # type: ignore[call-overload]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == [s.choices[0].message.content for s in singles]
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    chunks = list(client.chat.completions.create(n=3, seed=40, stream=True, **kwargs))  # type: ignore[call-overload]
    streamed = [
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(3)
    ]
    assert streamed == [c.message.content for c in many.choices]


def test_tokenize_counts_what_the_model_reads(hf_server: Server, tiny_qwen2_vl_dir: Path) -> None:
    from transformers import AutoConfig

    url = hf_server.base_url
    messages = _messages("chelsea_1024.jpg", "Count me.")
    counted = httpx.post(url + "/tokenize", json={"model": "tiny-qwen2-vl", "messages": messages}, timeout=60).json()
    chat = httpx.post(
        url + "/v1/chat/completions", json={"model": "tiny-qwen2-vl", "messages": messages, "max_tokens": 1}, timeout=60
    ).json()
    assert counted["count"] == len(counted["tokens"]) == chat["usage"]["prompt_tokens"]
    pad = httpx.post(url + "/tokenize", json={"model": "tiny-qwen2-vl", "prompt": "<|image_pad|>"}, timeout=60).json()[
        "tokens"
    ]
    assert len(pad) == 1
    assert counted["tokens"].count(pad[0]) == 24  # the 1024x681 photo at the fixture's bounds (tests/hf_fixture.py)
    max_len = AutoConfig.from_pretrained(tiny_qwen2_vl_dir).get_text_config().max_position_embeddings
    assert counted["max_model_len"] == max_len
    assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == max_len
    text = httpx.post(
        url + "/detokenize", json={"model": "tiny-qwen2-vl", "tokens": counted["tokens"]}, timeout=60
    ).json()["prompt"]
    assert text.count("<|image_pad|>") == 24 and "Count me." in text
    bad = httpx.post(url + "/detokenize", json={"model": "tiny-qwen2-vl", "tokens": [10**6]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(url + "/tokenize", json={"model": "tiny-qwen2-vl"}, timeout=60)
    assert both.status_code == 400 and both.json()["error"]["param"] == "messages"


def test_mm_processor_kwargs_change_the_image_tokens_and_the_cache_key(hf_server: Server) -> None:
    url = hf_server.base_url
    messages = _messages("chelsea_1024.jpg", "Tokens?")

    def prompt_tokens(**extra: object) -> int:
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "tiny-qwen2-vl", "messages": messages, "max_tokens": 1, **extra},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])

    default = prompt_tokens()
    small = prompt_tokens(mm_processor_kwargs={"max_pixels": 28 * 28 * 8})
    assert small <= default - 16  # 24 image tokens by default, at most 8 now
    assert prompt_tokens() == default  # the same image, default options again: not the small tensors
    counted = httpx.post(
        url + "/tokenize",
        json={"model": "tiny-qwen2-vl", "messages": messages, "mm_processor_kwargs": {"max_pixels": 28 * 28 * 8}},
        timeout=60,
    )
    assert counted.json()["count"] == small
    bad = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "tiny-qwen2-vl", "messages": messages, "mm_processor_kwargs": {"patch_size": 7}},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mm_processor_kwargs"


# -- n > 1 records what one choice records (gateway/render.py: one loop for both) --------------------------

HANG_GUARD_S = 60.0


def _body(n: int, *, stream: bool = False, max_tokens: int = 4, **extra: object) -> dict[str, object]:
    return {
        "model": "tiny-qwen2-vl",
        "n": n,
        "stream": stream,
        "max_tokens": max_tokens,
        "seed": 7,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url((IMAGES / "chelsea_640.jpg").read_bytes())}},
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ],
        **extra,
    }


_COUNTS = {
    "ok": 'shmgate_requests_total{outcome="ok"}',
    "cancelled": 'shmgate_requests_total{outcome="cancelled"}',
    "server_error": 'shmgate_requests_total{outcome="server_error"}',
    "ttft": "shmgate_time_to_first_token_seconds_count",
    "delivery": 'shmgate_stage_duration_seconds_count{stage="delivery"}',
}


def _counts(server: Server) -> dict[str, float]:
    return {name: server.metric(metric) for name, metric in _COUNTS.items()}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices_record_one_ttft_and_a_delivery_stage_per_choice(hf_server: Server, stream: bool) -> None:
    before = _counts(hf_server)
    r = httpx.post(hf_server.base_url + "/v1/chat/completions", json=_body(3, stream=stream), timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        finished = {c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]}
        assert finished == {0, 1, 2}
    else:
        assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    after = _counts(hf_server)
    assert {k: after[k] - before[k] for k in ("ok", "ttft", "delivery")} == {"ok": 1, "ttft": 1, "delivery": 3}


def test_n_choices_say_where_their_time_went_in_server_timing(hf_server: Server) -> None:
    r = httpx.post(hf_server.base_url + "/v1/chat/completions", json=_body(2), timeout=60)
    assert r.status_code == 200, r.text
    spent = parse_server_timing(r.headers["server-timing"])
    assert {"body_read", "preprocess", "queue", "compute", "delivery", "total"} <= set(spent)
    assert all(value >= 0 for value in spent.values())
    assert spent["compute"] <= spent["total"]


def test_n_choices_whose_client_hangs_up_are_all_cancelled(hf_server: Server, tiny_qwen2_vl_dir: Path) -> None:
    """Two long generations (end of sequence biased away) stop when the client of the whole answer leaves."""
    server = hf_server
    wait_until(lambda: server.metric("shmgate_in_flight_requests") == 0, HANG_GUARD_S, "idle")
    before = _counts(server)
    tokens = server.metric("shmgate_cancelled_tokens_total")
    max_tokens = 8000
    data = json.dumps(
        _body(2, max_tokens=max_tokens, temperature=0, logit_bias=no_eos_bias(tiny_qwen2_vl_dir))
    ).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(data)
    ) + data
    go = threading.Event()

    def client() -> None:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(request)
            go.wait(HANG_GUARD_S)

    thread = threading.Thread(target=client)
    thread.start()
    try:
        wait_until(lambda: server.metric("shmgate_in_flight_requests") >= 2, HANG_GUARD_S, "both choices in flight")
        time.sleep(0.5)  # generating by now
    finally:
        go.set()
        thread.join()
    wait_until(
        lambda: (
            server.metric(_COUNTS["cancelled"]) >= before["cancelled"] + 2
            and server.metric("shmgate_in_flight_requests") == 0
        ),
        HANG_GUARD_S,
        "both choices cancelled",
    )
    after = _counts(server)
    assert {k: after[k] - before[k] for k in ("ok", "cancelled", "server_error")} == {
        "ok": 0,
        "cancelled": 2,
        "server_error": 0,
    }
    generated = server.metric("shmgate_cancelled_tokens_total") - tokens
    assert generated < max_tokens, f"{generated:.0f} of {2 * max_tokens} tokens generated for nobody"


def test_a_short_request_sent_while_a_long_answer_streams_ends_before_it(
    hf_server: Server, tiny_qwen2_vl_dir: Path
) -> None:
    """Continuous batching over HTTP: the short request joins the running rows at the next step instead of
    waiting for the long answer (a static batch would answer it only after the long one's 300 tokens)."""
    bias = no_eos_bias(tiny_qwen2_vl_dir)
    steps = hf_server.metric("shmgate_engine_steps_total")
    long = {
        "model": "tiny-qwen2-vl",
        "messages": _messages("chelsea_640.jpg", "Tell me everything."),
        "max_tokens": 300,
        "temperature": 0,
        "logit_bias": bias,
        "stream": True,
    }
    short = {**long, "messages": _messages("camera_640.jpg", "Short."), "max_tokens": 4, "stream": False}
    order: list[str] = []

    async def run() -> None:
        async with httpx.AsyncClient(base_url=hf_server.base_url, timeout=120) as client:

            async def ask_short() -> None:
                reply = await client.post("/v1/chat/completions", json=short)
                assert reply.status_code == 200, reply.text
                order.append("short done")

            task = None
            async with client.stream("POST", "/v1/chat/completions", json=long) as response:
                async for line in response.aiter_lines():
                    if task is None and line.startswith("data: {") and '"content"' in line:
                        order.append("long first")
                        task = asyncio.create_task(ask_short())
                    if line == "data: [DONE]":
                        order.append("long done")
            assert task is not None
            await task

    asyncio.run(run())
    assert order == ["long first", "short done", "long done"]
    assert hf_server.metric("shmgate_engine_steps_total") > steps
    assert hf_server.metric("shmgate_engine_running_requests") == 0  # idle again: the gauges say so


def test_a_repeated_image_is_encoded_once_and_its_prompts_kv_reused(hf_server: Server) -> None:
    """The second turn's image has the first's content key: the worker's encoder cache answers for it, and
    the prompt, the same up to its last token, starts from the first's KV (the prefix cache)."""
    hits, runs, prefixes, reused = (
        hf_server.metric("shmgate_encoder_cache_hits_total"),
        hf_server.metric("shmgate_vision_tower_runs_total"),
        hf_server.metric("shmgate_prefix_cache_hits_total"),
        hf_server.metric("shmgate_prefix_cache_reused_tokens_total"),
    )
    image = {
        "type": "image_url",
        "image_url": {"url": data_url(noise_png(4040, size=96), mime="image/png")},
    }  # seen by no other test
    body = {
        "model": "tiny-qwen2-vl",
        "messages": [{"role": "user", "content": [image, {"type": "text", "text": "Once."}]}],
        "max_tokens": 2,
        "temperature": 0,
    }
    for _ in range(2):
        assert httpx.post(hf_server.base_url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    wait_until(lambda: hf_server.metric("shmgate_encoder_cache_hits_total") >= hits + 1, 10, "the hit reported")
    assert hf_server.metric("shmgate_vision_tower_runs_total") == runs + 1
    assert hf_server.metric("shmgate_prefix_cache_hits_total") >= prefixes + 1
    assert hf_server.metric("shmgate_prefix_cache_reused_tokens_total") >= reused + 16  # whole 16-token blocks


# -- structured outputs (response_format) through the OpenAI client ---------------------------------------

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
PET_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True}}


def test_json_schema_answers_parse_and_validate_greedy_sampled_streamed_and_n(hf_server: Server) -> None:
    import jsonschema

    client = openai.OpenAI(base_url=hf_server.base_url + "/v1", api_key="unused")
    base = dict(model="tiny-qwen2-vl", messages=_messages("chelsea_640.jpg", "Which pet?"), max_tokens=80)
    greedy = client.chat.completions.create(response_format=PET_FORMAT, temperature=0, **base)  # type: ignore[arg-type]
    sampled = client.chat.completions.create(response_format=PET_FORMAT, temperature=1.0, seed=3, n=2, **base)  # type: ignore[arg-type]
    stream = client.chat.completions.create(response_format=PET_FORMAT, temperature=0, stream=True, **base)  # type: ignore[arg-type]
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    answers = [greedy.choices[0], *sampled.choices]
    assert all(choice.finish_reason == "stop" for choice in answers)
    for text in [choice.message.content or "" for choice in answers] + [streamed]:
        jsonschema.validate(json.loads(text), PET_SCHEMA)
    assert streamed == greedy.choices[0].message.content


def test_json_object_and_an_unusable_schema(hf_server: Server) -> None:
    client = openai.OpenAI(base_url=hf_server.base_url + "/v1", api_key="unused")
    base = dict(model="tiny-qwen2-vl", messages=_messages("chelsea_640.jpg", "Answer in JSON."), max_tokens=120)
    answer = client.chat.completions.create(response_format={"type": "json_object"}, temperature=0, **base)  # type: ignore[arg-type]
    text = answer.choices[0].message.content or ""
    assert text.startswith("{")
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    bad = {"type": "json_schema", "json_schema": {"name": "pet", "schema": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(response_format=bad, **base)  # type: ignore[arg-type]
    assert refused.value.body["param"] == "response_format"  # type: ignore[index]
