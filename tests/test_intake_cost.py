"""The cheaper intake paths answer exactly as the plain ones: one decode for a usual body, SIMD base64.

gateway/intake.py decodes a body without unknown top-level fields once (the unknown-field warning's
second pass only runs when there is something to warn about), and base64-decodes through pybase64
when it is installed. Neither may change what a client gets back.
"""

from __future__ import annotations

import base64
import binascii
import importlib.util
import itertools
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from shmgate.gateway import intake
from shmgate.gateway.intake import IntakeLimits, parse_chat_request, strict_b64decode
from shmgate.shared.errors import InvalidRequest

LIMITS = IntakeLimits()
IMAGES = Path(__file__).parent / "data" / "images"
PIXEL = base64.b64encode(b"\x89PNG not really").decode()


def body(**extra: Any) -> bytes:
    content = [
        {"type": "text", "text": "hi"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PIXEL}"}},
    ]
    return json.dumps({"model": "checksum", "messages": [{"role": "user", "content": content}], **extra}).encode()


def test_a_body_without_unknown_fields_is_not_read_a_second_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bytes] = []
    monkeypatch.setattr(intake, "warn_unknown_fields", calls.append)
    chat = parse_chat_request(body(temperature=0.5, max_tokens=3), LIMITS)
    assert chat.params.temperature == 0.5 and len(chat.images) == 1
    assert calls == []
    parse_chat_request(body(store=True), LIMITS)
    assert len(calls) == 1  # an unknown field still reaches the warning


def test_unknown_fields_are_still_ignored_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="shmgate.gateway.intake"):
        chat = parse_chat_request(body(cost_test_unknown_z={"nested": [1, 2]}, seed=7), LIMITS)
    assert chat.params.seed == 7
    assert any("cost_test_unknown_z" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("raw", "message", "param"),
    [
        (b"{not json", "not valid JSON", None),
        (body(temperature="hot"), "Expected `float", "temperature"),
        (body(cost_test_unknown_w=1, temperature="hot"), "Expected `float", "temperature"),
        (body(guided_json={"type": "object"}), "send response_format", "guided_json"),
        (b'{"model": "m", "messages": [], "extra": ' + b"[" * 2000 + b"]" * 2000 + b"}", "nests", None),
    ],
)
def test_errors_are_the_lenient_decoders(raw: bytes, message: str, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_chat_request(raw, LIMITS)
    assert message in str(caught.value) and caught.value.param == param


def _strict(text: str) -> bytes | None:
    try:
        return binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError):
        return None


def _ours(text: str) -> bytes | None:
    try:
        return strict_b64decode(text)
    except (binascii.Error, ValueError):
        return None


def test_base64_accepts_and_refuses_what_strict_binascii_does() -> None:
    """Every string of up to five characters of an alphabet with the edge cases (padding, URL-safe,
    whitespace, a stray character): the same bytes or the same refusal."""
    alphabet = "AQgw+/=_- \n."
    for n in range(6):
        for chars in itertools.product(alphabet, repeat=n):
            text = "".join(chars)
            assert _ours(text) == _strict(text), text
    photo = base64.b64encode(bytes(range(256)) * 500).decode()
    assert strict_b64decode(photo) == bytes(range(256)) * 500
    assert _ours(photo[:-1] + "é") is None  # not ASCII


def test_pybase64_is_used_when_installed() -> None:
    assert (intake._simd_decode is not None) == (importlib.util.find_spec("pybase64") is not None)


def test_an_image_keyed_for_its_answer_and_then_its_tensors_is_hashed_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a result cache a miss keys each image twice (the answer, then the tensors): one hash of its text."""
    from shmgate.gateway.preprocess.vision import ChecksumPreprocessor
    from shmgate.gateway.result_cache import answer_key
    from shmgate.shared.vocabulary import content_key, key_of_digest, material_digest

    hashed: list[int] = []

    def counted(data: bytes | str) -> bytes:
        hashed.append(len(data))
        return material_digest(data)

    monkeypatch.setattr(intake, "material_digest", counted)
    photo = base64.b64encode((IMAGES / "camera_640.jpg").read_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{photo}"}}]
    chat = parse_chat_request(
        json.dumps({"model": "checksum", "messages": [{"role": "user", "content": content}]}).encode(), LIMITS
    )
    preprocessor = ChecksumPreprocessor()
    assert answer_key(chat, preprocessor) is not None
    params = preprocessor.cache_params()  # the tensor key's parameters for an image without processor options
    tensor_key = key_of_digest(intake.image_digest(chat.images[0]), params)
    assert hashed == [len(photo)]  # the answer's key hashed the text; the tensor key reused that digest
    assert tensor_key == content_key(photo, params)  # the one formula, whichever way it is reached


def test_content_keys_keep_kinds_and_parameters_apart() -> None:
    from shmgate.shared.vocabulary import content_key

    data = (IMAGES / "camera_640.jpg").read_bytes()
    text = base64.b64encode(data).decode()
    assert content_key(text, b"p") == content_key(text, b"p")
    assert content_key(text, b"p") != content_key(data, b"p")  # a data URL and fetched bytes: two entries
    assert content_key(text, b"p") != content_key(text, b"q")
    assert content_key(b"ab", b"c") != content_key(b"a", b"bc")  # the parameters' length is in the key
