"""Slow and idle connections are cut below the API key check, and a frontend's connections are capped.

A real ``shmgate serve --model checksum`` with one frontend and small limits (a 2 s head deadline, a 2 s
body deadline extended by a second per 100 bytes, at most 250 connections). Clients are raw non-blocking
sockets: a slow-loris of 200 connections that send their head a byte at a time, 20 that drip a body, 10
that never send a byte. Times are hang guards, never pass/fail figures.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.serving import Server, image_request, noise_png, start_server, stop_and_check, wait_until

MAX_CONNECTIONS = 250
HANG_GUARD_S = 20.0


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        "checksum",
        tmp_path_factory.mktemp("serve"),
        "--frontends",
        "1",
        "--workers",
        "1",
        "--api-key",
        "k",
        "--header-timeout-s",
        "2",
        "--body-timeout-s",
        "2",
        "--body-min-rate",
        "100",
        "--max-connections",
        str(MAX_CONNECTIONS),
    )
    try:
        yield server
    finally:
        stop_and_check(server)


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class SlowClient:
    """One connection that sends a byte of its head (or body) per tick, or nothing; records its end."""

    HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\nX-Pad: " + b"a" * 500

    def __init__(self, port: int, kind: str) -> None:
        self.kind = kind
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setblocking(False)
        self.received = b""
        self.closed = False
        self.to_send = self.HEAD
        if kind == "body":
            self.sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
            )

    def tick(self) -> None:
        if self.closed:
            return
        try:
            if self.kind == "head":
                self.sock.send(self.to_send[:1])
                self.to_send = self.to_send[1:]
            elif self.kind == "body":
                self.sock.send(b" ")
        except OSError:
            pass  # the server closed; the read below sees the end
        try:
            while chunk := self.sock.recv(65536):
                self.received += chunk
        except BlockingIOError:
            return
        except OSError:
            pass
        self.closed = True
        self.sock.close()

    def error_code(self) -> str | None:
        """The OpenAI error code of the response the server wrote before closing (None: no response)."""
        head, _, body = self.received.partition(b"\r\n\r\n")
        if not head:
            return None
        return str(json.loads(body)["error"]["code"])


def test_a_slow_loris_is_cut_while_ordinary_requests_are_answered_and_descriptors_stay_bounded(
    strict_server: Server,
) -> None:
    server = strict_server
    pid = server.frontend_pid(0)
    assert pid is not None
    fds_before = _open_fds(pid)
    clients = [SlowClient(server.port, "head") for _ in range(200)]
    clients += [SlowClient(server.port, "body") for _ in range(20)] + [
        SlowClient(server.port, "idle") for _ in range(10)
    ]
    body = image_request("checksum", noise_png(3, size=64), mime="image/png")
    statuses: list[int] = []
    latencies: list[float] = []
    fds_max = 0
    started = time.monotonic()
    with httpx.Client(base_url=server.base_url, timeout=HANG_GUARD_S, headers={"Authorization": "Bearer k"}) as c:
        while not all(s.closed for s in clients):
            assert time.monotonic() - started < HANG_GUARD_S, (
                f"{sum(not s.closed for s in clients)} slow connections still open"
            )
            for s in clients:
                s.tick()
            fds_max = max(fds_max, _open_fds(pid))
            t = time.monotonic()
            statuses.append(c.post("/v1/chat/completions", json=body).status_code)
            latencies.append(time.monotonic() - t)
            time.sleep(0.05)
    cut_after = time.monotonic() - started
    assert set(statuses) == {200}, statuses
    codes = {kind: [s.error_code() for s in clients if s.kind == kind] for kind in ("head", "body", "idle")}
    assert all(code == "request_timeout" for code in codes["head"] + codes["idle"] + codes["body"]), codes
    assert fds_max <= fds_before + len(clients) + 20
    wait_until(lambda: _open_fds(pid) <= fds_before + 5, HANG_GUARD_S, "the frontend's descriptors back")
    print(
        f"\nslow-loris: {len(clients)} slow connections all cut (408) in {cut_after:.1f} s; "
        f"{len(statuses)} ordinary requests 200, p50 {sorted(latencies)[len(latencies) // 2] * 1000:.0f} ms, "
        f"max {max(latencies) * 1000:.0f} ms; frontend fds {fds_before} -> max {fds_max}"
    )


def test_connections_beyond_the_cap_get_a_503_and_are_closed(strict_server: Server) -> None:
    server = strict_server
    clients = [SlowClient(server.port, "idle") for _ in range(MAX_CONNECTIONS + 20)]
    try:
        refused: list[SlowClient] = []
        deadline = time.monotonic() + HANG_GUARD_S
        while len(refused) < 20 and time.monotonic() < deadline and not all(s.closed for s in clients):
            for s in clients:
                s.tick()
            refused = [s for s in clients if s.closed and s.received.startswith(b"HTTP/1.1 503")]
            time.sleep(0.05)
        # (at least one: a slow accept under load may let the first ones reach their head deadline first)
        assert refused, "no connection past the cap was refused"
        assert {s.error_code() for s in refused} == {"too_many_connections"}
    finally:
        for s in clients:
            if not s.closed:
                s.sock.close()
