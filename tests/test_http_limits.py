"""The connection limits of gateway/http_limits.py, for both HTTP implementations uvicorn may run.

A real uvicorn server (in a thread of the test process, on a free port) runs each protocol class with
small limits around a tiny ASGI app that reads the whole body and answers its length; clients are raw
sockets. The serving tests (tests/test_slow_clients.py) show the same limits on ``shmgate serve``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from shmgate.gateway.http_limits import ConnectionLimits, http_protocol
from tests.serving import free_port, wait_until

LIMITS = ConnectionLimits(header_timeout_s=0.5, body_timeout_s=0.5, body_min_rate=100, max_connections=5)
GUARD_S = 10.0


class App:
    """Reads the body; answers its length, or records that the client went away mid-body."""

    def __init__(self) -> None:
        self.disconnects = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnects += 1
                return
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = str(size).encode()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]}
        )
        await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module", params=["httptools", "h11"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[int, App]]:
    app = App()
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http=http_protocol(LIMITS, prefer=request.param),
        log_level="warning",
        lifespan="off",
        timeout_keep_alive=5,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, GUARD_S, "uvicorn started")
    try:
        yield port, app
    finally:
        server.should_exit = True
        thread.join(GUARD_S)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(GUARD_S)
    return s


def _read_until_closed(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def _error_code(response: bytes) -> str:
    head, _, body = response.partition(b"\r\n\r\n")
    return str(json.loads(body)["error"]["code"])


def _post(body: bytes) -> bytes:
    return b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def test_a_head_sent_a_byte_at_a_time_is_cut_with_a_408(served: tuple[int, App]) -> None:
    port, _ = served
    with _connect(port) as s:
        started = time.monotonic()
        for byte in b"POST / HTTP/1.1\r\nHost: x\r\n":
            try:
                s.send(bytes([byte]))
            except OSError:
                break
            time.sleep(0.1)
            if time.monotonic() - started > GUARD_S:
                break
        response = _read_until_closed(s)
    assert response.startswith(b"HTTP/1.1 408") and _error_code(response) == "request_timeout"


def test_a_connection_that_never_sends_is_cut(served: tuple[int, App]) -> None:
    port, _ = served
    with _connect(port) as s:
        response = _read_until_closed(s)
    assert response.startswith(b"HTTP/1.1 408")


def test_a_dripping_body_is_cut_and_the_app_sees_a_disconnect(served: tuple[int, App]) -> None:
    port, app = served
    disconnects = app.disconnects
    with _connect(port) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        s.setblocking(False)
        response = b""
        started = time.monotonic()
        while time.monotonic() - started < GUARD_S:
            try:
                s.send(b"x")
                chunk = s.recv(65536)
            except BlockingIOError:
                time.sleep(0.1)
                continue
            except OSError:
                break
            if not chunk:
                break
            response += chunk
    assert response.startswith(b"HTTP/1.1 408") and _error_code(response) == "request_timeout"
    wait_until(lambda: app.disconnects == disconnects + 1, GUARD_S, "the app saw the disconnect")


def test_a_whole_request_and_an_idle_keep_alive_connection_are_not_cut(served: tuple[int, App]) -> None:
    port, _ = served
    with _connect(port) as s:
        s.sendall(_post(b"x" * 300))
        assert s.recv(65536).endswith(b"\r\n\r\n300")
        time.sleep(LIMITS.header_timeout_s * 3)  # idle between requests: uvicorn's keep-alive (5 s) decides
        s.sendall(_post(b"y" * 20))
        assert s.recv(65536).endswith(b"\r\n\r\n20")


def test_connections_past_the_cap_get_a_503(served: tuple[int, App]) -> None:
    port, _ = served
    held = [_connect(port) for _ in range(LIMITS.max_connections)]
    try:
        for h in held:  # answered and idle: kept open by uvicorn's keep-alive, never cut by a head deadline
            h.sendall(_post(b"z"))
            assert h.recv(65536).startswith(b"HTTP/1.1 200")
        with _connect(port) as s:
            response = _read_until_closed(s)
        assert response.startswith(b"HTTP/1.1 503") and _error_code(response) == "too_many_connections"
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("flag", ["--header-timeout-s", "--body-timeout-s", "--body-min-rate"])
def test_a_limit_of_zero_is_refused_when_the_flags_are_parsed(flag: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shmgate.gateway", "serve", flag, "0"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and flag in result.stderr and "must be more than 0" in result.stderr
