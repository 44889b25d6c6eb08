"""A bound on the HTTP request head (request line + headers), which uvicorn's httptools parser lacks.

uvicorn picks httptools when it is installed, and httptools buffers a header of any size:
one client sending ``X-A: aaaa...`` without end grew a frontend by 400 MB (measured, uvicorn
0.54 / httptools 0.9). h11 has ``max_incomplete_event_size`` (16 KiB by default); vLLM fixed
the same hole (GHSA-rxc4-3w6r-4v47) by setting it. ``http_protocol`` keeps httptools' speed
and adds the bound: while a request's head is incomplete, the bytes received on the
connection are counted, and past ``MAX_HEAD_BYTES`` the client gets a 431 in OpenAI form and
the connection is closed.

The count is of whole socket reads, so a read that also carries the tail of a previous
(pipelined) request's body counts against the next head; one read is at most 256 KiB, hence
the generous 1 MiB bound, which still caps the memory a connection can pin before the app runs.

The same protocol answers requests httptools cannot parse (``Content-Length: abc``, a bad
request line) with an OpenAI error object instead of uvicorn's plain-text 400, so that every
error a client can get from a frontend has one shape.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from gateway.http_errors import error_body
from shared.errors import RequestError

__all__ = ["MAX_HEAD_BYTES", "http_protocol", "read_capped"]

MAX_HEAD_BYTES = 1 << 20


def _closing_response(status: bytes, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 response carrying an OpenAI error object, after which we close."""
    body = json.dumps(error_body(message, "invalid_request_error", code)).encode()
    head = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
    return head % (status, len(body)) + body


_TOO_LARGE = _closing_response(b"431 Request Header Fields Too Large",
                               f"the request line and headers are larger than {MAX_HEAD_BYTES} bytes",
                               "headers_too_large")
_UNPARSABLE = _closing_response(b"400 Bad Request", "the HTTP request could not be parsed", "invalid_http")


def http_protocol() -> type[asyncio.Protocol] | str:
    """The protocol class for ``uvicorn.Config(http=...)``: bounded httptools, else h11 with its bound."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: h11 bounds the head itself (max_incomplete_event_size)
        return "h11"

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _head_bytes = 0
        _in_head = True  # from the connection's start or a message's end until headers are complete

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._head_bytes = 0
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_head = True
            super().on_message_complete()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._in_head or self.transport.is_closing():
                return
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self.transport.write(_TOO_LARGE)
                self.transport.close()

        def send_400_response(self, msg: str) -> None:  # httptools could not parse the request
            self.transport.write(_UNPARSABLE)
            self.transport.close()

    return BoundedHttpToolsProtocol


async def read_capped(
    declared_length: str | None, chunks: AsyncIterator[bytes], limit: int, what: str, too_large: type[RequestError]
) -> bytes:
    """A body of at most ``limit`` bytes, refused with ``too_large`` (a 413) as soon as it is known to be larger.

    One reader for both bodies we accept from the network, a client's request and a fetched image:
    a declared Content-Length over the limit is refused before reading, and a body without one
    (chunked) is cut off at the limit instead of being buffered whole. ``what`` names the body in
    the error message ("the request body", "the image").
    """
    declared = (declared_length or "").strip()
    if declared.isdigit() and int(declared) > limit:
        raise too_large(f"{what} is larger than {limit} bytes")
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise too_large(f"{what} is larger than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)
