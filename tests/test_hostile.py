"""Hostile input against one real ``shmgate serve --model checksum``: each is answered precisely, nobody else suffers.

Every case is sent together with a well-formed request for a different image; the hostile one
gets exactly the status and OpenAI error code in its row (or, where the input is awkward but
legitimate, a 200 whose checksum proves which pixels the worker saw), the well-formed one gets
its own checksum, and the server is still ready afterwards.

Decisions these tests pin down (docs/RELIABILITY.md, "Hostile input"):
- Unknown fields are accepted and ignored at every level, as the OpenAI API's clients expect
  of a server (newer SDKs send fields older servers do not know), except the names that would
  change the answer's form (gateway/intake.py; tests/test_contract.py); unknown *values* of a
  known field (a part type, a role) are 400s naming the field.
- The data URL's MIME type must be one we accept, but the bytes decide the format: a PNG sent
  as image/jpeg is decoded as the PNG it is.
- base64 may contain whitespace (line-wrapped encoders); missing padding, the URL-safe alphabet
  and other characters are 400s.
- Animated WebP: the first frame is used. GIF (animated or not) is refused by name.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import json
import re
import socket
import struct
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
from PIL import Image, ImageOps

from tests.serving import (
    IMAGES,
    Server,
    data_url,
    expected_checksum,
    image_request,
    noise_png,
)
from tests.test_imaging import encode, exif_rotated_jpeg, handmade_png

CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Case:
    body: bytes
    status: int
    code: str | None = None  # the OpenAI error code of a 4xx
    param: str | None = None  # the error's param, where one is expected
    digest: str | None = None  # for a 200: the blake2b the worker must report for the pixels


def _json(body: object) -> bytes:
    return json.dumps(body).encode()


def _chat(content: object, **extra: object) -> bytes:
    return _json({"model": "checksum", "messages": [{"role": "user", "content": content}], **extra})


def _image(url: str, **extra: object) -> bytes:
    return _chat([{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}], **extra)


def _solid_digest(colour: tuple[int, int, int]) -> str:
    """What the worker reports for any image of one colour: the (3, 224, 224) crop is that colour."""
    planes = np.stack([np.full((224, 224), c, np.uint8) for c in colour])
    return hashlib.blake2b(planes.tobytes(), digest_size=16).hexdigest()


def _jpeg_with_segments(jpeg: bytes, segments: list[bytes]) -> bytes:
    """Insert APPn segments right after SOI (where EXIF and ICC live)."""
    return jpeg[:2] + b"".join(segments) + jpeg[2:]


def _app(n: int, payload: bytes) -> bytes:
    return bytes([0xFF, 0xE0 + n]) + struct.pack(">H", len(payload) + 2) + payload


def _jpeg_claiming(jpeg: bytes, width: int, height: int) -> bytes:
    """A real JPEG whose SOF0 header is patched to claim another size."""
    sof = jpeg.index(b"\xff\xc0")
    return jpeg[: sof + 5] + struct.pack(">HH", height, width) + jpeg[sof + 9 :]


def _cases() -> dict[str, Case]:
    red = Image.new("RGB", (64, 48), (200, 10, 10))
    jpeg = encode(Image.open(IMAGES / "coffee_640.jpg").resize((160, 120)), "JPEG", quality=90)
    png = encode(red, "PNG")
    b64 = base64.b64encode(png).decode()
    frames = [Image.new("RGB", (32, 32), c) for c in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]
    animated_webp = encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=50, lossless=True)
    animated_gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    huge_exif = _app(1, b"Exif\x00\x00" + bytes(range(256)) * 255)  # one 65 KB APP1 of garbage TIFF
    many_apps = [_app(2 + i % 12, b"x" * 1000) for i in range(4000)]  # 4 MB of metadata
    sixteen_bit = encode(Image.fromarray(np.full((40, 30), 100 * 257, np.uint16)), "PNG")
    cmyk = encode(Image.new("CMYK", (64, 64), (0, 255, 255, 0)), "JPEG", quality=95)
    urlsafe = base64.urlsafe_b64encode(noise_png(77)).decode()
    assert "-" in urlsafe or "_" in urlsafe
    hi = {"role": "user", "content": "hi"}
    return {
        # -- bombs and sizes
        "png claiming 100000x100000": Case(
            _image(data_url(handmade_png(100_000, 100_000), "image/png")),
            413,
            "image_too_large",
            "messages[0].content[1].image_url",
        ),
        "jpeg claiming 65500x65500": Case(
            _image(data_url(_jpeg_claiming(jpeg, 65500, 65500))),
            413,
            "image_too_large",
            "messages[0].content[1].image_url",
        ),
        "png 0x0": Case(
            _image(data_url(handmade_png(0, 0), "image/png")), 400, "invalid_image", "messages[0].content[1].image_url"
        ),
        "png 1x1": Case(
            _image(data_url(encode(Image.new("RGB", (1, 1), (1, 2, 3)), "PNG"), "image/png")),
            200,
            digest=_solid_digest((1, 2, 3)),
        ),
        "png 1x10000": Case(
            _image(data_url(encode(Image.new("RGB", (1, 10000), (9, 8, 7)), "PNG"), "image/png")),
            200,
            digest=_solid_digest((9, 8, 7)),
        ),
        "png 10000x1": Case(
            _image(data_url(encode(Image.new("RGB", (10000, 1), (7, 8, 9)), "PNG"), "image/png")),
            200,
            digest=_solid_digest((7, 8, 9)),
        ),
        # -- metadata, animation, modes
        "jpeg with a 65 KB garbage EXIF": Case(
            _image(data_url(_jpeg_with_segments(jpeg, [huge_exif]))), 200, digest=expected_checksum(jpeg)
        ),
        "jpeg with 4000 APP segments": Case(
            _image(data_url(_jpeg_with_segments(jpeg, many_apps))), 200, digest=expected_checksum(jpeg)
        ),
        "animated webp: first frame": Case(
            _image(data_url(animated_webp, "image/webp")), 200, digest=_solid_digest((255, 0, 0))
        ),
        "animated gif, honest mime": Case(
            _image(data_url(animated_gif, "image/gif")), 400, "invalid_image", "messages[0].content[1].image_url"
        ),
        "animated gif sent as png": Case(
            _image(data_url(animated_gif, "image/png")), 400, "invalid_image", "messages[0].content[1].image_url"
        ),
        "16-bit grayscale png": Case(
            _image(data_url(sixteen_bit, "image/png")), 200, digest=_solid_digest((100, 100, 100))
        ),
        "cmyk jpeg": Case(_image(data_url(cmyk)), 200, digest=expected_checksum(cmyk)),
        # -- data URLs and base64
        "png sent as image/jpeg": Case(_image(data_url(png, "image/jpeg")), 200, digest=_solid_digest((200, 10, 10))),
        "png sent as text/plain": Case(
            _image(data_url(png, "text/plain")), 400, "invalid_image", "messages[0].content[1].image_url"
        ),
        "base64 wrapped at 76 columns": Case(
            _image("data:image/png;base64," + "\r\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))),
            200,
            digest=_solid_digest((200, 10, 10)),
        ),
        "base64 without padding": Case(
            _image("data:image/png;base64," + b64.rstrip("=")),
            400,
            "invalid_request",
            "messages[0].content[1].image_url",
        ),
        "base64 with a '!'": Case(
            _image("data:image/png;base64," + b64[:20] + "!" + b64[20:]),
            400,
            "invalid_request",
            "messages[0].content[1].image_url",
        ),
        "url-safe base64": Case(
            _image("data:image/png;base64," + urlsafe), 400, "invalid_request", "messages[0].content[1].image_url"
        ),
        "data url without base64": Case(_image("data:image/png," + b64), 400, "invalid_request"),
        # -- JSON shape and size
        "100k nested arrays": Case(b"[" * 100_000 + b"]" * 100_000, 400, "invalid_request"),
        "100k nested arrays in an unknown field": Case(
            b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b',"model":"checksum","messages":[' + _json(hi) + b"]}",
            400,
            "invalid_request",
        ),
        "100k nested objects, unclosed": Case(b'{"x":' + b'{"a":' * 100_000, 400, "invalid_request"),
        "200k unknown keys": Case(
            b"{"
            + b",".join(b'"k%d":%d' % (i, i) for i in range(200_000))
            + b',"model":"checksum","messages":['
            + _json(hi)
            + b"]}",
            200,
        ),
        "5000 content parts": Case(_chat([{"type": "text", "text": "x"}] * 5000), 400, "invalid_request", "messages"),
        "5000 messages": Case(
            _json({"model": "checksum", "messages": [hi] * 5000}), 400, "invalid_request", "messages"
        ),
        "a 3 MiB prompt": Case(_chat("x" * (3 << 20)), 400, "invalid_request", "messages"),
        "a 1,000,000-character prompt (under the limit)": Case(_chat("é" * 1_000_000), 200),
        "invalid utf-8 in a string": Case(
            b'{"model":"checksum","messages":[{"role":"user","content":"\xc3("}]}', 400, "invalid_request"
        ),
        "a lone surrogate escape": Case(_chat("\\ud800").replace(b"\\\\", b"\\"), 400, "invalid_request"),
        "NaN max_tokens": Case(
            b'{"model":"checksum","max_tokens":NaN,"messages":[' + _json(hi) + b"]}", 400, "invalid_request"
        ),
        "unknown fields at every level": Case(
            _json(
                {
                    "model": "checksum",
                    "future": {"a": [1]},
                    "stream_options": None,
                    "messages": [
                        {
                            "role": "user",
                            "x": 1,
                            "content": [
                                {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}},
                                {
                                    "type": "image_url",
                                    "image_url": {"url": data_url(png, "image/png"), "detail": "low", "y": 2},
                                    "z": 3,
                                },
                            ],
                        }
                    ],
                }
            ),
            200,
            digest=_solid_digest((200, 10, 10)),
        ),
        "unknown part type": Case(
            _chat([{"type": "input_audio", "input_audio": {}}]), 400, "invalid_request", "messages[0].content[0].type"
        ),
        "unknown role": Case(
            _json({"model": "checksum", "messages": [{"role": "wizard", "content": "hi"}]}),
            400,
            "invalid_request",
            "messages[0].role",
        ),
        # -- sampling parameters
        "n=2": Case(_chat("hi", n=2), 400, "invalid_request", "n"),
        "max_tokens=-1": Case(_chat("hi", max_tokens=-1), 400, "invalid_request", "max_tokens"),
        "max_tokens=10**30": Case(_chat("hi", max_tokens=10**30), 400, "invalid_request", "max_tokens"),
        "temperature=-0.5": Case(_chat("hi", temperature=-0.5), 400, "invalid_request", "temperature"),
        "temperature=1e999": Case(
            b'{"model":"checksum","temperature":1e999,"messages":[' + _json(hi) + b"]}",
            400,
            "invalid_request",
            "temperature",
        ),
        "top_p=0": Case(_chat("hi", top_p=0), 400, "invalid_request", "top_p"),
        "five stop strings": Case(_chat("hi", stop=["a", "b", "c", "d", "e"]), 400, "invalid_request", "stop"),
        "seed=2**64": Case(_chat("hi", seed=2**64), 400, "invalid_request", "seed"),
    }


# Wrong types, one field at a time: each is a 400 naming that field.
WRONG_TYPES: dict[str, object] = {
    "model": 1,
    "messages": {"role": "user"},
    "stream": "yes",
    "stream_options": 1,
    "max_tokens": "5",
    "max_completion_tokens": 2.5,
    "temperature": "hot",
    "top_p": [1],
    "seed": "x",
    "stop": 5,
    "n": "2",
    "user": 5,
}

# Wrong types inside a message: the 400 names the path to the offending value.
NESTED_WRONG_TYPES: dict[str, tuple[object, str]] = {
    "messages[0].role": ({"role": 1, "content": "hi"}, "messages[0].role"),
    "messages[0].content": ({"role": "user", "content": 5}, "messages[0].content"),
    "messages[0].name": ({"role": "user", "content": "hi", "name": []}, "messages[0].name"),
    "a part's text": ({"role": "user", "content": [{"type": "text", "text": 5}]}, "messages[0].content[0].text"),
    "a part's type": ({"role": "user", "content": [{"type": 5, "text": "x"}]}, "messages[0].content[0].type"),
    "image_url as a string": (
        {"role": "user", "content": [{"type": "image_url", "image_url": "data:,"}]},
        "messages[0].content[0].image_url",
    ),
    "image_url.url": (
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": None}}]},
        "messages[0].content[0].image_url.url",
    ),
    "a message that is a string": ("hi", "messages[0]"),
}

CASES = _cases()


async def _alongside_a_good_request(
    server: Server, body: bytes, seed: int
) -> tuple[httpx.Response, bytes, httpx.Response]:
    good = noise_png(seed, size=64)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
        hostile, ok = await asyncio.gather(
            client.post(CHAT, content=body, headers={"Content-Type": "application/json"}),
            client.post(CHAT, json=image_request("checksum", good, mime="image/png")),
        )
    return hostile, good, ok


def _check_error(response: httpx.Response, status: int, code: str | None, param: str | None) -> None:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    assert "shmgate." not in error["message"]


def _check_digest(response: httpx.Response, digest: str | None) -> None:
    assert response.status_code == 200, response.text[:500]
    answer = json.loads(response.json()["choices"][0]["message"]["content"])
    if digest is None:
        assert answer == {"tensors": []}
    else:
        assert [t["blake2b"] for t in answer["tensors"]] == [digest]


def _send_and_check(server: Server, case: Case, seed: int) -> None:
    hostile, good, ok = asyncio.run(_alongside_a_good_request(server, case.body, seed))
    if case.status == 200:
        _check_digest(hostile, case.digest)
    else:
        _check_error(hostile, case.status, case.code, case.param)
    _check_digest(ok, expected_checksum(good))


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_input_is_answered_precisely_and_a_concurrent_request_is_unaffected(
    spare_slot_server: Server, name: str
) -> None:
    _send_and_check(spare_slot_server, CASES[name], seed=list(CASES).index(name))


@pytest.mark.parametrize("field", list(WRONG_TYPES))
def test_a_wrongly_typed_field_is_a_400_naming_it(spare_slot_server: Server, field: str) -> None:
    body = {"model": "checksum", "messages": [{"role": "user", "content": "hi"}], field: WRONG_TYPES[field]}
    _send_and_check(spare_slot_server, Case(_json(body), 400, "invalid_request", field), seed=100 + len(field))


@pytest.mark.parametrize("name", list(NESTED_WRONG_TYPES))
def test_a_wrongly_typed_value_inside_a_message_is_a_400_naming_its_path(spare_slot_server: Server, name: str) -> None:
    message, param = NESTED_WRONG_TYPES[name]
    body = _json({"model": "checksum", "messages": [message]})
    _send_and_check(spare_slot_server, Case(body, 400, "invalid_request", param), seed=150 + len(name))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_before_preprocessing(spare_slot_server: Server, orientation: int) -> None:
    stored = exif_rotated_jpeg((200, 120), orientation)  # small: never drafted, so both paths decode fully
    # Pillow's own exif_transpose is the reference; the pre-rotated copy carries no orientation.
    pre_rotated = encode(ImageOps.exif_transpose(Image.open(io.BytesIO(stored))).convert("RGB"), "PNG")
    _send_and_check(
        spare_slot_server,
        Case(_image(data_url(stored)), 200, digest=expected_checksum(pre_rotated)),
        seed=200 + orientation,
    )


def test_every_hostile_input_at_once_leaves_the_good_requests_intact(spare_slot_server: Server) -> None:
    goods = [noise_png(300 + i, size=64) for i in range(8)]

    async def run() -> tuple[list[httpx.Response], list[httpx.Response]]:
        limits = httpx.Limits(max_connections=len(CASES) + len(goods))
        async with httpx.AsyncClient(base_url=spare_slot_server.base_url, timeout=120, limits=limits) as client:
            hostile = [
                client.post(CHAT, content=c.body, headers={"Content-Type": "application/json"}) for c in CASES.values()
            ]
            good = [client.post(CHAT, json=image_request("checksum", g, mime="image/png")) for g in goods]
            results = await asyncio.gather(*hostile, *good)
        return list(results[: len(CASES)]), list(results[len(CASES) :])

    hostile, good = asyncio.run(run())
    for case, response in zip(CASES.values(), hostile):
        if case.status == 200:
            _check_digest(response, case.digest)
        else:
            _check_error(response, case.status, case.code, case.param)
    for data, response in zip(goods, good):
        _check_digest(response, expected_checksum(data))
    assert httpx.get(spare_slot_server.base_url + "/ready", timeout=10).status_code == 200
    assert spare_slot_server.metric('shmgate_requests_total{outcome="server_error"}') == 0


# -- the HTTP layer: heads and bodies that never end ------------------------------------------------------


def _raw_exchange(server: Server, head: bytes, filler: bytes, max_mib: int) -> bytes:
    """Send ``head`` then up to ``max_mib`` MiB of ``filler`` until the server answers or closes; its answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head)
        try:
            for _ in range(max_mib):
                sock.sendall(filler * max(1, (1 << 20) // len(filler)))
        except OSError:  # the server closed the connection: its answer is waiting
            pass
        answer = b""
        with contextlib.suppress(OSError):
            while not _complete(answer) and (chunk := sock.recv(65536)):
                answer += chunk
    return answer


def _complete(answer: bytes) -> bool:
    """A whole response is in (the server may keep the connection open after a 413)."""
    head, found, body = answer.partition(b"\r\n\r\n")
    length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
    return bool(found and length and len(body) >= int(length.group(1)))


def _answer_json(answer: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


@pytest.mark.parametrize(
    ("name", "head", "filler"),
    [
        ("an endless header value", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: ", b"a"),
        ("an endless request line", b"GET /v1/models?q=", b"a"),
        ("endless headers", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"X-B: 1\r\n"),
    ],
)
def test_an_endless_request_head_is_cut_off_with_a_431(
    spare_slot_server: Server, name: str, head: bytes, filler: bytes
) -> None:
    # 64 MiB offered; the answer after ~1 MiB proves the frontend stopped buffering (it grew by
    # 400 MB on the same input before gateway/http_limits.py).
    status, body = _answer_json(_raw_exchange(spare_slot_server, head, filler, max_mib=64))
    assert status == 431
    assert body["error"]["code"] == "headers_too_large"  # type: ignore[index]
    _send_and_check(spare_slot_server, Case(_chat("hi"), 200), seed=400)


def test_an_unparsable_http_request_gets_an_openai_error(spare_slot_server: Server) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n"
    status, body = _answer_json(_raw_exchange(spare_slot_server, head, b"{}", max_mib=0))
    assert status == 400 and body["error"]["code"] == "invalid_http"  # type: ignore[index]
    _send_and_check(spare_slot_server, Case(_chat("hi"), 200), seed=402)


def test_a_chunked_body_without_length_is_cut_off_at_the_limit(spare_slot_server: Server) -> None:
    chunk = b"x" * (1 << 20)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += b"Transfer-Encoding: chunked\r\n\r\n"
    framed = b"%x\r\n" % len(chunk) + chunk + b"\r\n"
    status, body = _answer_json(_raw_exchange(spare_slot_server, head, framed, max_mib=40))
    assert status == 413 and body["error"]["code"] == "request_too_large"  # type: ignore[index]
    _send_and_check(spare_slot_server, Case(_chat("hi"), 200), seed=401)
