"""The load generator's HTTP client against a scripted loopback server: framing, reuse, failures."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from shmgate.shared.rawhttp import NoHttpAnswer, RawClient

Reply = Callable[[bytes], bytes | None]  # request head+body -> raw response bytes (None: close the connection)


async def _serve(reply: Reply) -> tuple[asyncio.Server, str, list[int]]:
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(
                    next(
                        line.split(b":")[1]
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    )
                )
                body = await reader.readexactly(length)
                raw = reply(head + body)
                if raw is None:
                    break
                writer.write(raw)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", connections


def _run(reply: Reply, exchange: Callable[[RawClient], object], timeout_s: float = 5.0) -> tuple[object, int]:
    async def main() -> tuple[object, int]:
        server, url, connections = await _serve(reply)
        client = RawClient(url, timeout_s=timeout_s)
        try:
            return await exchange(client), len(connections)  # type: ignore[misc]
        finally:
            await client.aclose()
            server.close()

    return asyncio.run(main())


def _fixed(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def test_content_length_responses_reuse_one_connection() -> None:
    async def exchange(client: RawClient) -> list[bytes]:
        out = []
        for _ in range(3):
            response, lease = await client.post("/x", b'{"a":1}')
            out.append(await response.read())
            lease.release()
        return out

    bodies, connections = _run(lambda request: _fixed(request.rsplit(b"\r\n\r\n", 1)[1]), exchange)
    assert bodies == [b'{"a":1}'] * 3 and connections == 1


def test_chunked_body_is_read_as_lines() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n7\r\ndata: a\r\n5\r\n\ndata\r\n4\r\n: b\n\r\n0\r\n\r\n"
    )

    async def exchange(client: RawClient) -> list[str]:
        response, lease = await client.post("/x", b"{}")
        lines = [line async for line in response.lines()]
        lease.release()
        return lines

    lines, _ = _run(lambda request: chunked, exchange)
    assert lines == ["data: a", "data: b"]


def test_a_closed_connection_is_a_transport_error_and_not_reused() -> None:
    calls = []

    def reply(request: bytes) -> bytes | None:
        calls.append(1)
        return None if len(calls) == 1 else _fixed(b"ok")

    async def exchange(client: RawClient) -> tuple[str, bytes]:
        with pytest.raises(NoHttpAnswer) as failure:
            await client.post("/x", b"{}")
        response, lease = await client.post("/x", b"{}")
        body = await response.read()
        lease.release()
        return failure.value.kind, body

    (kind, body), connections = _run(reply, exchange)
    assert kind == "ReadError" and body == b"ok" and connections == 2


def test_an_idle_connection_past_its_expiry_is_not_reused() -> None:
    """A server closes idle keep-alive connections after its timeout; the client gives them up first."""

    async def exchange(client: RawClient) -> list[bytes]:
        out = []
        for pause_s in (0.0, 0.0, 0.3):
            await asyncio.sleep(pause_s)
            response, lease = await client.post("/x", b"{}")
            out.append(await response.read())
            lease.release()
        return out

    async def main() -> tuple[list[bytes], int]:
        server, url, connections = await _serve(lambda request: _fixed(b"ok"))
        client = RawClient(url, keepalive_expiry_s=0.2)
        try:
            return await exchange(client), len(connections)
        finally:
            await client.aclose()
            server.close()

    bodies, connections = asyncio.run(main())
    assert bodies == [b"ok"] * 3 and connections == 2  # the third request, 0.3 s idle, opened a new one


def test_a_connection_the_server_closed_while_idle_is_not_reused() -> None:
    """No "connection: close", but the server hung up after answering: the next request goes on a new one."""

    async def main() -> tuple[list[bytes], int]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(1)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            writer.write(_fixed(b"ok"))
            await writer.drain()
            writer.close()  # answered, then closed, as a server's keep-alive timeout does

        connections: list[int] = []
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = RawClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        out = []
        try:
            for _ in range(2):
                response, lease = await client.post("/x", b"{}")
                out.append(await response.read())
                lease.release()
                await asyncio.sleep(0.05)  # the close reaches the client
            return out, len(connections)
        finally:
            await client.aclose()
            server.close()

    bodies, connections = asyncio.run(main())
    assert bodies == [b"ok"] * 2 and connections == 2


def test_garbage_status_line_is_a_protocol_error() -> None:
    async def exchange(client: RawClient) -> str:
        with pytest.raises(NoHttpAnswer) as failure:
            await client.post("/x", b"{}")
        return failure.value.kind

    kind, _ = _run(lambda request: b"SMTP ready\r\n\r\n", exchange)
    assert kind == "ProtocolError"


def test_refused_connection_is_a_connect_error() -> None:
    async def main() -> str:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        client = RawClient(f"http://127.0.0.1:{port}")
        with pytest.raises(NoHttpAnswer) as failure:
            await client.post("/x", b"{}")
        assert str(failure.value).startswith(f"nothing listening on 127.0.0.1:{port} (connection refused)")
        return failure.value.kind

    assert asyncio.run(main()) == "ConnectError"


def test_get_sends_the_path_under_the_base_urls_prefix_and_reuses_the_connection() -> None:
    async def exchange(client: RawClient) -> list[bytes]:
        out = []
        for _ in range(2):
            response, lease = await client.get("/v1/models")
            out.append(await response.read())
            lease.release()
        return out

    def reply(request: bytes) -> bytes:
        return _fixed(request.split(b"\r\n", 1)[0])

    async def main() -> tuple[list[bytes], int]:
        server, url, connections = await _serve(reply)
        client = RawClient(url + "/api")
        try:
            return await exchange(client), len(connections)
        finally:
            await client.aclose()
            server.close()

    bodies, connections = asyncio.run(main())
    assert bodies == [b"GET /api/v1/models HTTP/1.1"] * 2 and connections == 1


def test_only_plain_http_base_urls() -> None:
    with pytest.raises(ValueError):
        RawClient("https://127.0.0.1:1")
