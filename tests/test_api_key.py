"""``shmgate serve --api-key``, end to end: 401 in OpenAI form without the key, the OpenAI client works with it.

Two servers share these tests: metrics open (the default) and ``--metrics-need-key``. Health
and readiness stay open on both (orchestrators probe them without credentials).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import _serve
from tests.serving import Server, data_url, expected_checksum, image_request, noise_png

KEY = "sk-test-5f0c1e7a9b"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module", params=["metrics-open", "metrics-need-key"])
def keyed_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    extra = ["--workers", "1", "--max-workers", "2", "--api-key", KEY]
    if request.param == "metrics-need-key":
        extra.append("--metrics-need-key")
    yield from _serve("checksum", tmp_path_factory, *extra)


def _metrics_need_key(server: Server) -> bool:
    return "--metrics-need-key" in " ".join(server.process.args)  # type: ignore[arg-type]


def _assert_401(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert set(error) == {"message", "type", "param", "code"}
    assert KEY not in response.text


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        f"Basic {KEY}",
        f"Token {KEY}",
        KEY,
        "Bearer",
        "Bearer wrong",
        f"Bearer {KEY}x",
        f"Bearer {KEY[:-1]}",
        f"Bearer x{KEY}",
        f"Bearer {KEY.upper()}",
        f"Bearer {KEY} {KEY}",
    ],
)
def test_chat_without_the_right_bearer_key_is_401(keyed_server: Server, authorization: str | None) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    body = image_request("checksum", noise_png(1, size=32), mime="image/png")
    _assert_401(httpx.post(keyed_server.base_url + CHAT, json=body, headers=headers, timeout=30))


def test_the_key_is_checked_before_the_body_is_parsed(keyed_server: Server) -> None:
    response = httpx.post(
        keyed_server.base_url + CHAT,
        content=b"{not json",
        timeout=30,
        headers={"Content-Type": "application/json", "Authorization": "Bearer nope"},
    )
    _assert_401(response)


def test_models_needs_the_key(keyed_server: Server) -> None:
    _assert_401(httpx.get(keyed_server.base_url + "/v1/models", timeout=30))


def test_the_openai_client_with_the_key_works(keyed_server: Server) -> None:
    client = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key=KEY)
    assert [m.id for m in client.models.list()] == ["checksum"]
    image = noise_png(2, size=48)
    content = [{"type": "image_url", "image_url": {"url": data_url(image, "image/png")}}]
    reply = client.chat.completions.create(model="checksum", messages=[{"role": "user", "content": content}])
    digest = json.loads(reply.choices[0].message.content or "")["tensors"][0]["blake2b"]
    assert digest == expected_checksum(image)
    stream = client.chat.completions.create(
        model="checksum", messages=[{"role": "user", "content": content}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert json.loads(text)["tensors"][0]["blake2b"] == digest


def test_the_openai_client_with_a_wrong_key_gets_an_authentication_error(keyed_server: Server) -> None:
    client = openai.OpenAI(base_url=keyed_server.base_url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.models.list()
    assert caught.value.code == "invalid_api_key"


def test_the_bearer_scheme_is_case_insensitive(keyed_server: Server) -> None:
    response = httpx.get(keyed_server.base_url + "/v1/models", headers={"Authorization": f"bearer {KEY}"}, timeout=30)
    assert response.status_code == 200


@pytest.mark.parametrize("path", ["/health", "/ready"])
def test_health_endpoints_stay_open(keyed_server: Server, path: str) -> None:
    assert httpx.get(keyed_server.base_url + path, timeout=30).status_code == 200


def test_metrics_are_open_by_default_and_behind_the_key_with_metrics_need_key(keyed_server: Server) -> None:
    anonymous = httpx.get(keyed_server.base_url + "/metrics", timeout=30)
    keyed = httpx.get(keyed_server.base_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert keyed.status_code == 200 and "shmgate_requests_total" in keyed.text
    if _metrics_need_key(keyed_server):
        _assert_401(anonymous)
        _assert_401(httpx.get(keyed_server.base_url + "/metrics", headers={"Authorization": "Bearer no"}, timeout=30))
    else:
        assert anonymous.status_code == 200 and "shmgate_requests_total" in anonymous.text
