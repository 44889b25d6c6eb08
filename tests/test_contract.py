"""One error contract for every failure, against a real ``shmgate serve --model checksum`` over real HTTP.

- an exception no route expected is a 500 in OpenAI form with a request id, counted, and the
  keep-alive connection stays usable (the catch-all is also run on its own, under uvicorn, with a
  route that raises: no request of the real server is known to raise any more);
- the two inputs that used to raise (a non-ASCII digit in ``logit_bias``, an unreadable
  OpenMetrics ``Accept``) get a 400 and a text scrape;
- a client that closes mid-body is counted ``cancelled`` and logged in one line;
- error messages quote at most a few hundred characters of what the client sent;
- bodies are JSON only (415 otherwise), the Host header must be a loopback name, a trailing slash
  is a 404 and not a redirect;
- fields that change the answer's form are refused by name.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from shmgate.gateway.guards import AllowedHosts, CatchAll, default_allowed_hosts, parse_allowed_hosts
from shmgate.gateway.intake import FORM_FIELDS
from shmgate.gateway.metrics import Counter, FrontendStats
from tests.serving import Server, free_port, wait_until

CHAT = "/v1/chat/completions"
HI = {"model": "checksum", "messages": [{"role": "user", "content": "hi"}]}


def _body(**extra: object) -> bytes:
    return json.dumps({**HI, **extra}).encode()


# -- raw HTTP/1.1 on one connection ------------------------------------------------------------------------


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One whole response (Content-Length framed) from ``sock``: status, headers (lower-case), body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection: {data[:300]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    length = int(headers["content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        body += chunk
    return int(lines[0].split(" ", 2)[1]), headers, body


def _request(method: str, path: str, port: int, *, body: bytes = b"", headers: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def _two_on_one_connection(port: int, first: bytes, second: bytes) -> tuple[tuple[int, dict[str, str], bytes], ...]:
    """Send ``first``, read its answer, then ``second`` on the same connection (fails if it was closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(first)
        one = _read_response(sock)
        sock.sendall(second)
        return one, _read_response(sock)


def _openai_error(body: bytes) -> dict[str, object]:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


# -- the catch-all on its own ----------------------------------------------------------------------------


async def _raising_app(scope: Scope, receive: Receive, send: Send) -> None:
    """A route with a bug: ``/boom`` raises, anything else answers 200."""
    if scope["path"] == "/boom":
        raise KeyError("a bug")
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def guarded() -> Iterator[tuple[int, np.ndarray]]:
    """``_raising_app`` behind the real CatchAll and AllowedHosts, served by uvicorn in a thread; its counter row."""
    row = np.zeros(128, np.uint64)
    stats = FrontendStats(row)
    app = CatchAll(AllowedHosts(_raising_app, ("localhost", "127.0.0.1"), stats=lambda: stats), stats=lambda: stats)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "uvicorn started")
    yield port, row
    server.should_exit = True
    thread.join(30)


def test_a_stray_exception_is_a_500_in_openai_form_and_the_connection_stays_usable(
    guarded: tuple[int, np.ndarray], caplog: pytest.LogCaptureFixture
) -> None:
    port, row = guarded
    caplog.set_level(logging.INFO)
    (status, headers, body), (next_status, _, next_body) = _two_on_one_connection(
        port, _request("GET", "/boom", port), _request("GET", "/fine", port)
    )
    error = _openai_error(body)
    assert status == 500 and (error["type"], error["code"]) == ("server_error", "internal_error")
    assert headers["x-request-id"] in str(error["message"])
    assert (next_status, next_body) == (200, b"ok")
    assert row[Counter.REQUESTS_SERVER_ERROR] == 1 and row[Counter.REQUESTS_OK] == 0
    tracebacks = [r for r in caplog.records if r.exc_info]  # uvicorn's loggers propagate here too (log_config=None)
    assert len(tracebacks) == 1 and tracebacks[0].name == "shmgate.gateway.guards"
    assert headers["x-request-id"] in tracebacks[0].getMessage()


def test_the_host_check_refuses_other_names_with_an_openai_error(guarded: tuple[int, np.ndarray]) -> None:
    port, row = guarded
    refused_before = int(row[Counter.REQUESTS_CLIENT_ERROR])
    for host, allowed in [
        ("localhost:1", True),
        ("127.0.0.1", True),
        ("evil.example", False),
        ("evil.example:80", False),
        ("127.0.0.1.evil.example", False),
        (None, True),
    ]:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            head = "" if host is None else f"Host: {host}\r\n"  # none: an HTTP/1.0 probe; browsers always send one
            sock.sendall(f"GET /fine HTTP/1.1\r\n{head}\r\n".encode())
            status, _, body = _read_response(sock)
        if allowed:
            assert status == 200, host
        else:
            assert status == 421 and _openai_error(body)["code"] == "host_not_allowed", host
    assert row[Counter.REQUESTS_CLIENT_ERROR] - refused_before == 3


def test_the_default_hosts_are_the_loopback_names_only_when_listening_on_loopback() -> None:
    for listen in ("127.0.0.1", "localhost", "::1", "[::1]"):
        assert set(default_allowed_hosts(listen)) == {"localhost", "127.0.0.1", "::1"}, listen
    for listen in ("0.0.0.0", "::", "10.1.2.3", "gateway.internal"):
        assert default_allowed_hosts(listen) == ("*",), listen
    assert parse_allowed_hosts(" api.example , [::1]:8000,Other:9 ") == ("api.example", "::1", "other")
    assert parse_allowed_hosts("") == ()


def test_the_supervisor_hands_its_frontends_the_host_default_for_its_own_listen_address() -> None:
    from shmgate.node.cli import parse_config
    from shmgate.node.plan import declared_models, frontend_config

    for flags, want in [
        (["--host", "0.0.0.0"], "*"),
        (["--host", "127.0.0.1"], "localhost,127.0.0.1,::1"),
        (["--host", "::1"], "localhost,127.0.0.1,::1"),
        ([], "localhost,127.0.0.1,::1"),
        (["--host", "0.0.0.0", "--allowed-hosts", "api.example"], "api.example"),
    ]:
        parent = parse_config(["serve", *flags])
        child = frontend_config(parent, declared_models(parent), "abc", 0, 3)
        assert child.options.server.allowed_hosts == want, flags


# -- the real server ----------------------------------------------------------------------------------------


@pytest.fixture
def server(shared_checksum_server: Server) -> Server:
    """The checksum server this file shares with the others of its group (tests/conftest.py)."""
    return shared_checksum_server


def test_a_non_ascii_digit_in_logit_bias_is_a_400(server: Server) -> None:
    for key in ("²", "٣", "１"):  # isdigit() is true for each; int() refuses the first
        response = httpx.post(
            server.base_url + CHAT,
            content=_body(logit_bias={key: 1}),
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "logit_bias"


def test_an_unreadable_openmetrics_accept_gets_the_text_format_on_a_connection_that_stays_open(server: Server) -> None:
    before = server.metric('shmgate_requests_total{outcome="server_error"}')
    bad = _request("GET", "/metrics", server.port, headers="Accept: application/openmetrics-text; version=abc\r\n")
    (status, headers, body), (next_status, _, _) = _two_on_one_connection(
        server.port, bad, _request("GET", "/health", server.port)
    )
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert b"shmgate_requests_total" in body
    assert next_status == 200
    assert server.metric('shmgate_requests_total{outcome="server_error"}') == before


def test_a_client_that_hangs_up_mid_body_is_counted_cancelled_without_a_traceback(server: Server) -> None:
    before = server.metric('shmgate_requests_total{outcome="cancelled"}')
    tracebacks = server.log_path.read_text().count("Traceback")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_request("POST", CHAT, server.port, body=_body())[:-10])  # 10 bytes short of the body
        time.sleep(0.2)
    wait_until(
        lambda: server.metric('shmgate_requests_total{outcome="cancelled"}') > before,
        10,
        "the hang-up counted as cancelled",
    )
    log = server.log_path.read_text()
    assert log.count("Traceback") == tracebacks and "ClientDisconnect" not in log


def test_an_error_quotes_at_most_a_few_hundred_characters_of_the_input(server: Server) -> None:
    body = json.dumps({"model": "checksum", "messages": [{"role": "r" * 1_000_000, "content": "hi"}]})
    response = httpx.post(
        server.base_url + CHAT, content=body, headers={"Content-Type": "application/json"}, timeout=30
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].role"
    assert len(response.content) < 600
    assert sum(len(run) for run in re.findall("r{5,}", error["message"])) <= 200  # the role's characters
    assert error["message"].endswith("`$.messages[0].role`")  # the tail saying where survives the cut


def test_a_capped_message_keeps_its_head_and_tail_within_the_documented_bound() -> None:
    from shmgate.gateway.http_errors import MAX_MESSAGE_CHARS, capped

    for length in [*range(MAX_MESSAGE_CHARS - 5, MAX_MESSAGE_CHARS + 40), 10**4, 10**7]:
        message = "H" * 50 + "x" * (length - 100) + "T" * 50
        out = capped(message)
        assert len(out) <= MAX_MESSAGE_CHARS and out.startswith("H" * 50) and out.endswith("T" * 50), length
        assert out == message or "characters cut" in out


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json-patch+json",
        "application/jsonx",
    ],
)
def test_a_body_that_is_not_declared_json_is_a_415(server: Server, content_type: str) -> None:
    for path in (CHAT, "/v1/embeddings", "/tokenize"):
        response = httpx.post(
            server.base_url + path,
            content=_body(),
            headers={"Content-Type": content_type, "Origin": "http://evil.example"},
            timeout=30,
        )
        assert response.status_code == 415, (path, response.text)
        error = response.json()["error"]
        assert error["code"] == "unsupported_media_type" and "Content-Type: application/json" in error["message"]


@pytest.mark.parametrize(
    "content_type", [None, "application/json", "application/json; charset=utf-8", "Application/JSON"]
)
def test_json_or_no_content_type_is_accepted(server: Server, content_type: str | None) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = httpx.post(server.base_url + CHAT, content=_body(), headers=headers, timeout=30)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("evil.example", 421),
        ("evil.example:{port}", 421),
        ("localhost:{port}", 200),
        ("127.0.0.1:{port}", 200),
        ("[::1]:{port}", 200),
        ("LOCALHOST", 200),
    ],
)
def test_a_server_on_loopback_answers_only_loopback_host_names(server: Server, host: str, status: int) -> None:
    response = httpx.post(
        server.base_url + CHAT,
        content=_body(),
        timeout=30,
        headers={"Host": host.format(port=server.port), "Content-Type": "application/json"},
    )
    assert response.status_code == status, response.text
    if status != 200:
        assert response.json()["error"]["code"] == "host_not_allowed"


def test_a_trailing_slash_is_a_404_not_a_redirect_built_from_the_host(server: Server) -> None:
    response = httpx.post(
        server.base_url + CHAT + "/", content=_body(), timeout=30, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 404 and "location" not in response.headers
    assert _openai_error(response.content)["code"] == "not_found"


def test_vllms_guided_json_is_refused_with_what_to_send_instead(server: Server) -> None:
    response = httpx.post(
        server.base_url + CHAT,
        content=_body(guided_json={"type": "object"}),
        timeout=30,
        headers={"Content-Type": "application/json"},
    )
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "guided_json"
    assert 'send response_format {"type": "json_schema"' in error["message"], error


@pytest.mark.parametrize(
    ("field", "value"),
    [
        *[(name, {"type": "object"}) for name in FORM_FIELDS],
        ("guided_choice", ["a", "b"]),
        ("structured_outputs", {"json": {}}),
        ("modalities", ["text", "audio"]),
        ("modalities", ["audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("prediction", {"type": "content", "content": "x"}),
        ("echo", True),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),  # the classifier calls no tools
        ("tool_choice", "auto"),
        ("response_format", {"type": "json_object"}),
    ],
)
def test_a_field_that_changes_the_answer_form_is_refused_by_name(server: Server, field: str, value: object) -> None:
    response = httpx.post(
        server.base_url + CHAT,
        content=_body(**{field: value}),
        timeout=30,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


@pytest.mark.parametrize(
    "extra",
    [
        {"modalities": ["text"]},
        {"guided_json": None},
        {"echo": False},
        {"store": True, "metadata": {"a": "b"}, "service_tier": "auto"},
    ],
)
def test_harmless_or_absent_values_of_those_fields_are_accepted(server: Server, extra: dict[str, object]) -> None:
    response = httpx.post(
        server.base_url + CHAT, content=_body(**extra), timeout=30, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 200, response.text


def test_every_response_carries_a_request_id(server: Server) -> None:
    ids = {httpx.get(server.base_url + "/health", timeout=10).headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3 and all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids)
