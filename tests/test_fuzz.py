"""Fuzzing the request schema and the image intake: zero 5xx, zero stray exceptions, no hangs.

(a) Chat request bodies, from almost valid (the OpenAI structure with random values and
    random extra fields) to random JSON and random bytes, are POSTed to a running server:
    every answer is a 200 or an OpenAI error below 500, and the server stays ready.
(b) Real JPEG/PNG/WebP files, mutated (bit flips, byte sets, truncation, deletions,
    duplications and splices of another file), go through the frontend's image pipeline
    (``preprocess_image``: header check, decode, EXIF, resize, write) many times, and a smaller
    number through the server: only UndecodableImage / ImageTooLarge, and 400/413 over HTTP.

(c) schemathesis reads ``/openapi.json`` (gateway/openapi.py) from the running server and sends
    each operation requests generated from its schema, valid ones and, where there is a body,
    deliberately invalid ones: no 5xx, every status, content type and body as documented, every
    4xx an OpenAI error object.
(d) ``parse_chat_request`` gets bodies whose fields (top level, a message, a part) hold any JSON
    value, non-finite numbers included (``1e999`` reads as infinity): each ends in a parse or a
    RequestError, never another exception, and what parses samples with finite numbers a worker can use.
(e) ``mm_processor_kwargs`` of any shape go through a Qwen2-VL image processor: pixels, all finite,
    or a RequestError.

Counts stay small for CI (the file runs in about a minute on 2 busy cores); ``SHMGATE_FUZZ_EXAMPLES=N`` runs
N examples per component test and N/10 per server test, with fresh randomness.
tests/test_imaging.py has a simpler decode-only corruption fuzz; this one adds structural
mutations, more formats and the server.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from datetime import timedelta

import httpx
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from schemathesis import GenerationMode

from shmgate.gateway.intake import ChatCompletionRequest, IntakeLimits, image_bytes, parse_chat_request
from shmgate.gateway.openapi import openapi_document
from shmgate.gateway.preprocess.hf import HFPreprocessor
from shmgate.gateway.preprocess.vision import ChecksumPreprocessor
from shmgate.gateway.responses import ResponsesRequest, parse_responses_request
from shmgate.shared.errors import ImageTooLarge, RequestError, UndecodableImage
from shmgate.shared.wire import MIN_TEMPERATURE
from tests.serving import IMAGES, Server, data_url
from tests.test_imaging import encode, exif_rotated_jpeg

FUZZ_EXAMPLES = int(os.environ.get("SHMGATE_FUZZ_EXAMPLES", "0"))
MAX_PIXELS = 4_000_000
HANG_GUARD = timedelta(seconds=30)  # per example: generous, only a hang trips it


def fuzz_settings(default: int, *, server: bool = False) -> settings:
    wanted = FUZZ_EXAMPLES // 10 if server else FUZZ_EXAMPLES
    return settings(
        max_examples=max(default, wanted),
        deadline=HANG_GUARD,
        derandomize=FUZZ_EXAMPLES == 0,  # CI: the same examples every run; big runs: fresh ones
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.function_scoped_fixture,
        ],
    )


# -- seeds: real files of every format and mode the intake accepts ------------------------------------------


def _seeds() -> list[bytes]:
    photo = Image.open(IMAGES / "camera_640.jpg").convert("RGB").resize((80, 60))
    frames = [photo, photo.rotate(90), photo.transpose(Image.Transpose.FLIP_LEFT_RIGHT)]
    return [
        encode(photo, "JPEG", quality=85),
        encode(photo, "JPEG", quality=70, progressive=True, subsampling=2),
        encode(photo.convert("CMYK"), "JPEG"),
        exif_rotated_jpeg((64, 40), 6),
        encode(photo, "PNG"),
        encode(photo.convert("RGBA"), "PNG"),
        encode(photo.convert("P", palette=Image.Palette.ADAPTIVE), "PNG", transparency=0),
        encode(Image.fromarray(np.asarray(photo.convert("L"), np.uint16) * 257), "PNG"),
        encode(photo, "WEBP", quality=80),
        encode(photo, "WEBP", lossless=True),
        encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=40),
        encode(frames[0], "PNG", save_all=True, append_images=frames[1:], duration=40),  # APNG
    ]


SEEDS = _seeds()

# One mutation: (kind, position, argument); positions and lengths are taken modulo the file size.
MUTATION = st.tuples(
    st.sampled_from(["flip", "set", "truncate", "delete", "duplicate", "splice", "zero_run"]),
    st.integers(0, 1 << 20),
    st.integers(0, 1 << 16),
)


def mutate(data: bytes, mutations: list[tuple[str, int, int]], donor: bytes) -> bytes:
    out = bytearray(data)
    for kind, position, argument in mutations:
        if not out:
            break
        at = position % len(out)
        if kind == "flip":
            out[at] ^= 1 << (argument % 8)
        elif kind == "set":
            out[at] = argument % 256
        elif kind == "truncate":
            del out[max(1, at) :]
        elif kind == "delete":
            del out[at : at + 1 + argument % 64]
        elif kind == "duplicate":
            out[at:at] = out[at : at + 1 + argument % 256]
        elif kind == "splice":  # a slice of another file, e.g. a PNG chunk inside a JPEG segment
            start = argument % len(donor)
            out[at:at] = donor[start : start + 1 + position % 512]
        else:  # zero_run: lengths and sizes in headers become 0
            out[at : at + 1 + argument % 16] = bytes(len(out[at : at + 1 + argument % 16]))
    return bytes(out)


MUTATED_IMAGE = st.builds(
    lambda seed, donor, mutations: mutate(SEEDS[seed], mutations, SEEDS[donor]),
    st.integers(0, len(SEEDS) - 1),
    st.integers(0, len(SEEDS) - 1),
    st.lists(MUTATION, min_size=1, max_size=6),
)


def _run_pipeline(data: bytes) -> np.ndarray | None:
    """The frontend's image pipeline into a plain array; None when it refused the image."""
    out: dict[str, np.ndarray] = {}

    def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        out[name] = np.zeros(shape, dtype)
        return out[name]

    try:
        ChecksumPreprocessor().preprocess_image(data, allocate, max_pixels=MAX_PIXELS)
    except (UndecodableImage, ImageTooLarge):
        assert not out, "a refused image must not have allocated"
        return None
    return out["pixels"]


def test_every_seed_is_accepted_unmutated() -> None:
    for data in SEEDS:
        pixels = _run_pipeline(data)
        assert pixels is not None and pixels.shape == (3, 224, 224)


@fuzz_settings(300)
@given(data=MUTATED_IMAGE)
def test_mutated_images_give_pixels_or_our_errors_only(data: bytes) -> None:
    pixels = _run_pipeline(data)
    assert pixels is None or (pixels.shape == (3, 224, 224) and pixels.dtype == np.uint8)


@fuzz_settings(150)
@given(data=MUTATED_IMAGE, wrap=st.integers(0, 200))
def test_mutated_data_urls_through_request_parsing_give_request_errors_only(data: bytes, wrap: int) -> None:
    url = data_url(data, "image/png")
    if wrap:  # line-wrapped base64, as some encoders write it
        head, payload = url.split(",", 1)
        url = head + "," + "\n".join(payload[i : i + wrap] for i in range(0, len(payload), wrap))
    body = json.dumps(
        {
            "model": "checksum",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
        }
    ).encode()
    try:
        chat = parse_chat_request(body, IntakeLimits())
        (image,) = chat.images
        decoded = image_bytes(image)  # base64 is checked here
    except RequestError:
        return
    assert decoded == data
    _run_pipeline(decoded)


# -- the server ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(spare_slot_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=spare_slot_server.base_url, timeout=60) as c:
        yield c
    assert httpx.get(spare_slot_server.base_url + "/ready", timeout=10).status_code == 200


def _post(client: httpx.Client, body: bytes, *, allowed: tuple[int, ...]) -> httpx.Response:
    response = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code in allowed, (response.status_code, response.text[:300], body[:300])
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and "shmgate." not in error["message"]
    return response


def _png(seed: int) -> str:
    rng = np.random.default_rng(seed)
    return data_url(encode(Image.fromarray(rng.integers(0, 256, (12, 9, 3), dtype=np.uint8)), "PNG"), "image/png")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
ANY = st.one_of(JSON, st.just(2**70), st.just(-1), st.just(""), st.just(1e308))
URL = st.one_of(
    st.integers(0, 3).map(_png),
    st.text(max_size=40),
    st.builds(
        lambda t, p: f"data:{t};base64,{p}",
        st.sampled_from(["image/png", "image/gif", ""]),
        st.text("ABCDEFabc0123+/=\n _-", max_size=60),
    ),
)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(st.text(max_size=50), ANY)}),
    st.fixed_dictionaries(
        {
            "type": st.just("image_url"),
            "image_url": st.one_of(st.fixed_dictionaries({"url": URL}, optional={"detail": ANY, "extra": ANY}), ANY),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("video_url"), "video_url": st.one_of(st.fixed_dictionaries({"url": URL}), ANY)}
    ),
    st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["input_audio", "file", "refusal"]), ANY)}),
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "developer", "tool"]), ANY)},
    optional={
        "content": st.one_of(st.text(max_size=50), st.lists(PART, max_size=4), ANY),
        "name": ANY,
        "surprise": ANY,
    },
)
OPTIONAL = {
    name: ANY
    for name in [
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "user",
        "tools",
        "logprobs",
        "response_format",
    ]
}
OPTIONAL |= {"stream": st.booleans()}
CHAT_BODY = st.fixed_dictionaries(
    {"model": st.one_of(st.just("checksum"), ANY), "messages": st.one_of(st.lists(MESSAGE, max_size=3), ANY)},
    optional=OPTIONAL,
)


@fuzz_settings(150, server=True)
@given(body=CHAT_BODY)
def test_almost_valid_chat_requests_never_get_a_5xx(client: httpx.Client, body: dict[str, object]) -> None:
    response = _post(client, json.dumps(body).encode(), allowed=(200, 400, 404, 413))
    if response.status_code == 200 and body.get("stream") is True:
        assert response.text.rstrip().endswith("data: [DONE]")


@fuzz_settings(100, server=True)
@given(body=st.one_of(JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=300)))
def test_random_json_and_random_bytes_get_a_400(client: httpx.Client, body: bytes) -> None:
    _post(client, body, allowed=(400,))


@fuzz_settings(40, server=True)
@given(data=MUTATED_IMAGE)
def test_mutated_images_through_the_server_get_200_or_our_4xx(client: httpx.Client, data: bytes) -> None:
    body = json.dumps(
        {
            "model": "checksum",
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(data, "image/webp")}}]}
            ],
        }
    ).encode()
    response = _post(client, body, allowed=(200, 400, 413))
    if response.status_code == 200:  # the worker saw exactly the pixels the pipeline makes locally
        pixels = _run_pipeline(data)
        assert pixels is not None
        assert hashlib.blake2b(pixels.tobytes(), digest_size=16).hexdigest() in response.text
    else:
        assert response.json()["error"]["code"] in ("invalid_image", "image_too_large")


# -- (c) every route against its OpenAPI document -------------------------------------------------------

CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.response_schema_conformance,
]
# (path, method, mode) of every operation the server documents (the document is built the same way
# here): valid requests for each, and invalid ones where there is a body to get wrong.
OPERATIONS = [
    (path, method, mode)
    for path, item in openapi_document()["paths"].items()
    for method, operation in item.items()
    for mode in (
        [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if "requestBody" in operation else [GenerationMode.POSITIVE]
    )
]


@pytest.fixture(scope="module")
def api_schema(spare_slot_server: Server) -> object:
    return schemathesis.openapi.from_url(spare_slot_server.base_url + "/openapi.json")


@pytest.mark.parametrize(("path", "method", "mode"), OPERATIONS)
def test_every_route_answers_as_its_openapi_document_says(
    api_schema: object, spare_slot_server: Server, path: str, method: str, mode: GenerationMode
) -> None:
    # schemathesis's pytest plugin (from_fixture) fails on pytest 9; its strategies work under plain hypothesis.
    @fuzz_settings(12, server=True)
    @given(case=api_schema[path][method.upper()].as_strategy(mode))  # type: ignore[index]
    def run(case: schemathesis.Case) -> None:
        response = case.call_and_validate(base_url=spare_slot_server.base_url, checks=CHECKS, timeout=60)
        if 400 <= response.status_code < 500:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, response.text[:300]
            assert isinstance(error["message"], str), error
            assert error["type"] in ("invalid_request_error", "authentication_error"), error

    run()


@pytest.mark.parametrize(
    ("path", "model"),
    [
        ("/v1/models/{model}", "checksum"),
        ("/ready/{model}", "checksum"),
        ("/ready/{model}", "not-served"),
        ("/v1/models/{model}", "a/b"),
    ],
)
def test_one_models_routes_answer_as_documented_for_a_served_and_an_unknown_model(
    api_schema: object, spare_slot_server: Server, path: str, model: str
) -> None:
    """The fuzzer's ids are random, so it meets only the 404s: the served model's answer is checked here."""
    case = api_schema[path]["GET"].Case(path_parameters={"model": model})  # type: ignore[index]
    response = case.call_and_validate(base_url=spare_slot_server.base_url, checks=CHECKS, timeout=60)
    assert response.status_code == (200 if model == "checksum" else 404), response.text[:300]
    if model == "checksum":
        assert response.json()["model" if path.startswith("/ready") else "id"] == "checksum"


def test_the_document_lists_every_route_and_the_whole_request_body(spare_slot_server: Server) -> None:
    document = httpx.get(spare_slot_server.base_url + "/openapi.json", timeout=10).json()
    assert set(document["paths"]) == {
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
        "/v1/models",
        "/v1/models/{model}",
        "/health",
        "/version",
        "/ready",
        "/ready/{model}",
        "/metrics",
        "/docs",
        "/v1/files",
        "/v1/files/{file_id}",
        "/v1/files/{file_id}/content",
        "/v1/batches",
        "/v1/batches/{batch_id}",
        "/v1/batches/{batch_id}/cancel",
    }
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert {"400", "413", "415", "421", "429", "500", "503"} <= set(chat["responses"])
    body = document["components"]["schemas"]["ChatCompletionRequest"]
    assert set(body["properties"]) == set(ChatCompletionRequest.__struct_fields__)
    assert body["required"] == ["model", "messages"]


# -- (d) the body parser: any JSON value in any field ---------------------------------------------------------

# Strings that parse as numbers to one reader and not to another: Unicode digits pass str.isdigit()
# and fail int(); signs, spaces, exponents, underscores and huge values test each numeric check.
TRICKY = st.sampled_from(["²", "١٢", "１", "0", "-1", " 1", "1e3", "1_0", "99999999999", "\x00", "NaN", ""])
KEY = TRICKY | st.text(max_size=6)
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | TRICKY,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(KEY, children, max_size=3),
    max_leaves=12,
)
GOOD = {"model": "checksum", "messages": [{"role": "user", "content": "hi"}]}


def _parses_or_refuses(body: dict[str, object]) -> None:
    # Infinities as JSON numbers too large for a double (json.dumps writes the invalid word Infinity).
    text = json.dumps(body).replace("Infinity", "1e999")
    try:
        params = parse_chat_request(text.encode(), IntakeLimits()).params
    except RequestError:
        return
    numbers = [params.temperature, params.top_p, params.presence_penalty, params.frequency_penalty]
    assert all(math.isfinite(x) for x in numbers + [bias for _, bias in params.logit_bias]), params
    assert params.temperature == 0.0 or params.temperature >= MIN_TEMPERATURE, params


# Values shaped like what a field may hold (a map of numbers, a list of numbers) reach the checks
# behind the type check more often than arbitrary JSON does.
SMALL = (  # around the bounds the checks use (2, 100, 256, ...), and where float32 gives out
    st.integers(-300, 300) | st.floats(-300, 300) | st.sampled_from([1e-300, 5e-324, 1e-6, 1e308, float("inf")])
)
FIELD_VALUE = (
    ANY_JSON
    | SMALL
    | st.dictionaries(KEY, SMALL, min_size=1, max_size=2)
    | st.lists(SMALL | TRICKY, min_size=1, max_size=3)
)


@pytest.mark.parametrize("field", sorted(ChatCompletionRequest.__struct_fields__))
def test_any_json_value_in_any_field_parses_or_is_a_request_error(field: str) -> None:
    @fuzz_settings(20)
    @given(
        value=FIELD_VALUE,
        others=st.dictionaries(
            st.sampled_from(sorted(ChatCompletionRequest.__struct_fields__)), FIELD_VALUE, max_size=1
        ),
    )
    def run(value: object, others: dict[str, object]) -> None:
        _parses_or_refuses({**GOOD, **others, field: value})

    run()


@fuzz_settings(150)
@given(
    message=st.dictionaries(st.sampled_from(["role", "content", "name"]), ANY_JSON, max_size=3),
    part=st.dictionaries(
        st.sampled_from(["type", "text", "image_url"]), ANY_JSON | st.sampled_from(["text", "image_url"]), max_size=3
    ),
    image_url=st.dictionaries(st.sampled_from(["url", "detail"]), ANY_JSON, max_size=2),
)
def test_any_json_value_inside_a_message_parses_or_is_a_request_error(
    message: dict[str, object], part: dict[str, object], image_url: dict[str, object]
) -> None:
    _parses_or_refuses({**GOOD, "messages": [{"role": "user", **message}]})
    nested = {**part, "image_url": image_url} if part.get("type") == "image_url" else part
    _parses_or_refuses({**GOOD, "messages": [{"role": "user", "content": [nested]}]})


RESPONSES_GOOD = {"model": "checksum", "input": "hi"}
# text.format's members, and input parts' members, where a grammar or an image hides behind a type check
RESPONSES_NESTED = st.fixed_dictionaries(
    {"format": st.dictionaries(st.sampled_from(["type", "name", "schema", "strict"]), ANY_JSON, max_size=4)}
) | st.builds(
    lambda part: [{"role": "user", "content": [part]}],
    st.dictionaries(
        st.sampled_from(["type", "text", "image_url", "detail", "file_id"]),
        ANY_JSON
        | st.sampled_from(["input_text", "input_image", "output_text", "json_schema", "data:image/png;base64,"]),
        max_size=4,
    ),
)


@pytest.mark.parametrize("field", sorted(ResponsesRequest.__struct_fields__))
def test_any_json_value_in_any_responses_field_parses_or_is_a_request_error(field: str) -> None:
    @fuzz_settings(20)
    @given(value=FIELD_VALUE | RESPONSES_NESTED)
    def run(value: object) -> None:
        text = json.dumps({**RESPONSES_GOOD, field: value}).replace("Infinity", "1e999")
        try:
            params = parse_responses_request(text.encode(), IntakeLimits())[0].params
        except RequestError:
            return
        assert math.isfinite(params.temperature) and math.isfinite(params.top_p), params

    run()


# -- (e) image processor options of any shape ------------------------------------------------------------------

OPTION_KEYS = ["max_pixels", "min_pixels", "size", "image_mean", "image_std", "rescale_factor", "resample"]
OPTION_KEYS += ["do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "patch_size", "unknown"]
OPTION_VALUE = FIELD_VALUE | st.integers(1, 1 << 26) | st.lists(st.floats(-2, 2) | SMALL, min_size=3, max_size=3)


def test_any_processor_options_give_finite_pixels_or_a_request_error(tiny_qwen2_vl_dir: object) -> None:
    pre = HFPreprocessor(str(tiny_qwen2_vl_dir))
    image = encode(Image.open(IMAGES / "camera_640.jpg").convert("RGB").resize((40, 30)), "PNG")

    @fuzz_settings(60)
    @given(options=st.dictionaries(st.sampled_from(OPTION_KEYS), OPTION_VALUE, min_size=1, max_size=3))
    def run(options: dict[str, object]) -> None:
        out: dict[str, np.ndarray] = {}

        def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
            out[name] = np.zeros(shape, dtype)
            return out[name]

        try:
            chosen = pre.image_options(options, None)
            pre.plan_image(40, 30, chosen)
            pre.preprocess_image(image, allocate, max_pixels=MAX_PIXELS, options=chosen)
        except RequestError:
            return
        assert np.isfinite(out["pixel_values"]).all(), options

    run()
