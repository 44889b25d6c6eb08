"""A small HTTP(S) server on 127.0.0.1 for image-URL tests: answers from a route table, records requests.

It only ever binds 127.0.0.1. Routes are plain data (``Route``), so a test states what the
far side does (redirect, stall, lie about its length) next to what it expects from us.
A stalled route waits on ``release`` (set when the host stops), never on a bare sleep.
"""

from __future__ import annotations

import ssl
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

STALL_LIMIT_S = 30.0  # a stalled answer ends by itself after this, whatever the test does


@dataclass
class Route:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    send_length: bool = True  # False: no Content-Length, the body ends when the connection closes
    stall: bool = False  # send the headers and 16 bytes, then wait for ``ImageHost.release``


@dataclass
class Seen:
    path: str
    headers: dict[str, str]  # lower-cased names


class ImageHost:
    """The route table and request log shared with the handler threads."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.seen: list[Seen] = []
        self.release = threading.Event()
        self.port = 0
        self.scheme = "http"

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

    def paths(self) -> list[str]:
        return [s.path for s in self.seen]


def _handler(host: ImageHost) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection; close-delimited bodies work

        def do_GET(self) -> None:
            host.seen.append(Seen(self.path, {k.lower(): v for k, v in self.headers.items()}))
            route = host.routes.get(self.path, Route(404, b"not found"))
            try:
                self.send_response(route.status)
                for name, value in route.headers.items():
                    self.send_header(name, value)
                if route.send_length:
                    self.send_header("Content-Length", str(len(route.body)))
                self.end_headers()
                if route.stall:
                    self.wfile.write(route.body[:16])
                    self.wfile.flush()
                    host.release.wait(STALL_LIMIT_S)
                    return
                self.wfile.write(route.body)
            except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                pass  # the client stopped reading, which is what cap tests want

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@contextmanager
def serve_images(tls: ssl.SSLContext | None = None) -> Iterator[ImageHost]:
    """Run an ImageHost on 127.0.0.1 (HTTPS when ``tls`` is given) until the block ends."""
    host = ImageHost()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(host))
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
        host.scheme = "https"
    host.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield host
    finally:
        host.release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


def self_signed(directory: Path, hostname: str) -> tuple[Path, Path]:
    """(certificate, key) for ``hostname``, made by the openssl command; the cert is its own CA."""
    cert, key = directory / f"{hostname}.crt", directory / f"{hostname}.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN={hostname}",
            "-addext",
            f"subjectAltName=DNS:{hostname}",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key
