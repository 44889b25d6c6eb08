"""A minimal keep-alive HTTP/1.1 client on asyncio streams: the load generator's and the batch runner's.

Why not httpx: on the 2-core machines we benchmark on, the load generator shares the cores with
the server it measures, and httpx spends ~3-4 ms of CPU per 200 KB request (its h11 state machine
and layers of abstraction). Every millisecond the client burns is taken from the server, so a
heavy client compresses the differences the benchmark exists to show. The batch runner
(gateway/batch_runner.py) sends each batch line to its own node with it for the same reason: there
the client's CPU is the frontends' own (measured: 1.1 ms per small chat request with httpx, 0.16 ms
with this client). It does only what those two need: POST a body (or GET the model list), read a
Content-Length or chunked response, optionally line by line (SSE). It speaks to servers on loopback
that we start ourselves; it is not a general client.

Failures (connection refused or reset, malformed response, timeout) raise ``NoHttpAnswer``.
A connection is reused only after a response was read to its end; anything else closes it.
An idle connection is given up after ``KEEPALIVE_EXPIRY_S``, before the server's own keep-alive
timeout (uvicorn's default is 5 s) can close it: a request sent on a connection the server is
closing at that moment gets no answer. Open-loop runs at low rates leave connections idle that
long, and this race showed as a few ``transport:ReadError`` per run, for every server alike.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

__all__ = ["Lease", "RawClient", "Response", "NoHttpAnswer", "connect_failure"]

MAX_HEADER_BYTES = 64 << 10
KEEPALIVE_EXPIRY_S = 4.0  # below uvicorn's default timeout_keep_alive (5 s); see the module docstring

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class NoHttpAnswer(Exception):
    """The server gave no usable HTTP answer. ``kind``: ConnectError, ReadError or ProtocolError
    (httpx's names for the same failures, so reports read alike whichever client ran).

    Not ``shared.errors.TransportError``: that one is the gateway's shared-memory transport failing
    (a 503 it answers); this is the client getting no answer at all.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Response:
    """A response whose body is read through ``read()`` or ``lines()`` (once)."""

    def __init__(self, status: int, headers: dict[str, str], reader: asyncio.StreamReader) -> None:
        self.status = status
        self.headers = headers
        self._reader = reader
        self.complete = False

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self._chunks()])

    async def lines(self) -> AsyncIterator[str]:
        """The body split on newlines (without them), as SSE readers want it."""
        pending = b""
        async for chunk in self._chunks():
            pending += chunk
            *done, pending = pending.split(b"\n")
            for line in done:
                yield line.rstrip(b"\r").decode()
        if pending:
            yield pending.decode()

    async def _chunks(self) -> AsyncIterator[bytes]:
        reader = self._reader
        try:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    if size == 0:
                        await reader.readuntil(b"\r\n")  # no trailers from the servers we test
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            else:
                length = int(self.headers.get("content-length", "0"))
                if length:
                    yield await reader.readexactly(length)
        except (ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as exc:
            raise NoHttpAnswer("ReadError", f"bad response body: {exc!r}") from exc
        self.complete = True


class RawClient:
    """Keep-alive connections to one ``http://host:port`` base URL, at most one request each at a time."""

    def __init__(
        self,
        base_url: str,
        *,
        headers: dict[str, str] | None = None,
        timeout_s: float = 60.0,
        keepalive_expiry_s: float = KEEPALIVE_EXPIRY_S,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"this client speaks plain http only: {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or 80
        self._prefix = parts.path.rstrip("/")
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._fixed_headers = f"Host: {parts.netloc}\r\nContent-Type: application/json\r\n{extra}"
        self.timeout_s = timeout_s
        self._keepalive_expiry_s = keepalive_expiry_s
        self._idle: list[tuple[Connection, float]] = []  # with the time.monotonic() it went idle
        self._all: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> str:
        """``host:port``, as error messages name the server."""
        return f"{self._host}:{self._port}"

    async def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[Response, Lease]:
        """Send a POST (``headers``: this request's own, beside the client's) and read the status line and
        headers. Release the lease when done with the body."""
        return await self._request("POST", path, body, headers)

    async def get(self, path: str) -> tuple[Response, Lease]:
        """Send a GET (``/v1/models`` before a run) and read the status line and headers."""
        return await self._request("GET", path, b"")

    async def _request(
        self, method: str, path: str, body: bytes, headers: dict[str, str] | None = None
    ) -> tuple[Response, Lease]:
        conn = self._take_idle() or await self._connect()
        reader, writer = conn
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()) if headers else ""
        head = (
            f"{method} {self._prefix}{path} HTTP/1.1\r\n{self._fixed_headers}{extra}Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        try:
            writer.write(head)
            writer.write(body)
            raw = await reader.readuntil(b"\r\n\r\n")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            self._discard(writer)
            raise NoHttpAnswer("ReadError", f"no response: {exc!r}") from exc
        except BaseException:  # cancelled (a timeout) mid-exchange: the connection is unusable
            self._discard(writer)
            raise
        lines = raw.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError) as exc:
            self._discard(writer)
            raise NoHttpAnswer("ProtocolError", f"bad status line {lines[0]!r}") from exc
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        response = Response(status, headers, reader)
        return response, Lease(self, conn, response)

    def _take_idle(self) -> Connection | None:
        """The most recently used idle connection still fresh and open; older ones are closed."""
        expired = time.monotonic() - self._keepalive_expiry_s
        while self._idle:
            conn, since = self._idle.pop()
            if since >= expired and not conn[0].at_eof():
                return conn
            self._discard(conn[1])
        return None

    def _give_back(self, conn: Connection) -> None:
        self._idle.append((conn, time.monotonic()))

    async def _connect(self) -> Connection:
        try:
            reader, writer = await asyncio.open_connection(self._host, self._port, limit=MAX_HEADER_BYTES)
        except OSError as exc:
            raise NoHttpAnswer("ConnectError", connect_failure(self.address, exc)) from exc
        self._all.add(writer)
        return reader, writer

    def _discard(self, writer: asyncio.StreamWriter) -> None:
        self._all.discard(writer)
        writer.close()

    async def aclose(self) -> None:
        for writer in list(self._all):
            writer.close()
        self._all.clear()
        self._idle.clear()


def connect_failure(address: str, exc: OSError) -> str:
    """What a failed connect means to the person running the benchmark (the usual cause first)."""
    # A name with several addresses (localhost: ::1 and 127.0.0.1) fails with one OSError listing each.
    if isinstance(exc, ConnectionRefusedError) or f"[Errno {errno.ECONNREFUSED}]" in str(exc):
        return f"nothing listening on {address} (connection refused): is the server running on that port?"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host of {address}: {exc.strerror or exc}"
    return f"cannot connect to {address}: {exc.strerror or exc!r}"


class Lease:
    """Gives a connection back for reuse when its response was read to the end, else closes it."""

    def __init__(self, client: RawClient, conn: Connection, response: Response) -> None:
        self._client = client
        self._conn = conn
        self._response = response

    def release(self) -> None:
        reusable = self._response.complete and self._response.headers.get("connection", "").lower() != "close"
        if reusable:
            self._client._give_back(self._conn)
        else:
            self._client._discard(self._conn[1])
