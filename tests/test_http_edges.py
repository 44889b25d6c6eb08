"""RFC 9112's edges at the Host check, and ``null`` where OpenAI's schema allows it, on one real
``shmgate serve --model checksum`` (loopback: the allowed hosts are the loopback names).

- More than one Host, or a Host value that is not a host (userinfo, a list), is a 400; an
  absolute-form target naming a host not allowed is a 421 even under an allowed Host (the target's
  authority replaces Host, RFC 9112 sec. 3.2.2).
- Any Transfer-Encoding but ``chunked`` alone is a 501 (a proxy applying ``gzip`` would read other
  bytes than we do), and the connection is closed.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import _serve
from tests.serving import Server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve("checksum", tmp_path_factory, "--workers", "1")


def _exchange(server: Server, request: bytes) -> tuple[int, dict[str, object]]:
    """Send ``request`` on a fresh connection; the status and JSON body of the answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while True:
            head, found, body = answer.partition(b"\r\n\r\n")
            length = [
                int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")
            ]
            if found and length and len(body) >= length[0]:
                break
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return int(head.split(b" ", 2)[1]), json.loads(body)


def _get(target: str, *headers: str) -> bytes:
    return (f"GET {target} HTTP/1.1\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


@pytest.mark.parametrize(
    "hosts",
    [
        ("127.0.0.1:{port}", "evil.example"),  # two Host lines, one allowed
        ("127.0.0.1:{port}@evil.example",),
        ("localhost:{port}, evil.example",),
        ("127.0.0.1:{port} evil.example",),
    ],
)
def test_several_or_invalid_host_headers_are_a_400(server: Server, hosts: tuple[str, ...]) -> None:
    status, body = _exchange(server, _get("/v1/models", *(f"Host: {h.format(port=server.port)}" for h in hosts)))
    assert status == 400, body
    assert body["error"]["param"] == "Host"  # type: ignore[index]


def test_an_absolute_form_target_is_judged_by_its_own_authority(server: Server) -> None:
    allowed = f"Host: 127.0.0.1:{server.port}"
    status, body = _exchange(server, _get("http://evil.example/v1/models", allowed))
    assert status == 421 and body["error"]["code"] == "host_not_allowed"  # type: ignore[index]
    status, _ = _exchange(server, _get(f"http://localhost:{server.port}/v1/models", allowed))
    assert status == 200
    status, _ = _exchange(server, _get("/v1/models", allowed))
    assert status == 200
    # IPv6 literals are hosts: the loopback one allowed, another one not
    assert _exchange(server, _get("/v1/models", f"Host: [::1]:{server.port}"))[0] == 200
    assert _exchange(server, _get("/v1/models", "Host: [2001:db8::1]:8000"))[0] == 421


@pytest.mark.parametrize(
    "codings", [("gzip, chunked",), ("gzip", "chunked"), ("chunked, chunked",), ("identity, chunked",)]
)
def test_a_transfer_coding_other_than_chunked_alone_is_a_501(server: Server, codings: tuple[str, ...]) -> None:
    body = b'{"model": "checksum", "messages": [{"role": "user", "content": "hi"}]}'
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
    head += "".join(f"Transfer-Encoding: {c}\r\n" for c in codings) + "\r\n"
    status, answer = _exchange(server, head.encode() + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
    # 501 from the Host check's layer; httptools itself refuses a repeated "chunked" as unparsable (400)
    assert (status, answer["error"]["code"]) in ((501, "unsupported_transfer_coding"), (400, "invalid_http")), answer  # type: ignore[index]


def test_null_is_accepted_where_openais_schema_allows_it(server: Server) -> None:
    chat = {"model": "checksum", "messages": [{"role": "user", "content": "hi"}]}
    nulls = ["stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "user"]
    reply = httpx.post(server.base_url + "/v1/chat/completions", json={**chat, **dict.fromkeys(nulls)}, timeout=30)
    assert reply.status_code == 200, reply.text
    streamed = {**chat, "stream": True, "stream_options": {"include_usage": None}}
    reply = httpx.post(server.base_url + "/v1/chat/completions", json=streamed, timeout=30)
    assert reply.status_code == 200 and reply.text.rstrip().endswith("data: [DONE]"), reply.text


def test_null_options_of_an_embeddings_request_read_as_their_defaults() -> None:
    from shmgate.gateway.embeddings import EmbeddingRequest, _decoder
    from shmgate.gateway.intake import decode_body

    body = b'{"model": "m", "input": "hi", "encoding_format": null, "dimensions": null, "user": null}'
    req = decode_body(_decoder, body)
    assert isinstance(req, EmbeddingRequest) and req.encoding_format is None and req.dimensions is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "1e999"),
        ("temperature", "-1e999"),
        ("top_p", "1e999"),
        ("presence_penalty", "-1e999"),
        ("frequency_penalty", "1e999"),
        ("logit_bias", '{"1": 1e999}'),
    ],
)
def test_a_non_finite_sampling_number_is_a_400_naming_its_field(server: Server, field: str, value: str) -> None:
    # 1e999 is valid JSON and reads as infinity.
    body = f'{{"model": "checksum", "messages": [{{"role": "user", "content": "hi"}}], "{field}": {value}}}'
    reply = httpx.post(
        server.base_url + "/v1/chat/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"].startswith(field), reply.text


def test_a_temperature_too_small_for_float32_samples_greedily() -> None:
    from shmgate.gateway.intake import IntakeLimits, parse_chat_request

    for tiny in ("1e-300", "5e-324", "1e-6"):
        body = f'{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "temperature": {tiny}}}'
        assert parse_chat_request(body.encode(), IntakeLimits()).params.temperature == 0.0
