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

An absolute-form target (``GET http://evil.example/v1/models``) names its host in the target, and
RFC 9112 sec. 3.2.2 says the server then ignores ``Host``: the protocol puts the target's authority
in the ``Host`` header's place (``absolute_form_host``), so the Host check (gateway/guards.py) judges
the host the request really names.

It also cuts slow clients, below the API key check (``ConnectionLimits``). uvicorn closes a
keep-alive connection that stays idle after a response (``timeout_keep_alive``), but nothing
else: a connection that never sends a byte, a head sent one byte a second, or a body that drips
is kept forever, each holding a descriptor and a slot of ``--max-in-flight``'s budget for
nobody. Each connection is in one phase:

    HEAD   from its start, or its previous response's end, until its next head is complete:
           the head must be whole within ``header_timeout_s``
    BODY   head complete, body arriving: ``body_timeout_s``, plus one second for each
           ``body_min_rate`` bytes received (Apache's mod_reqtimeout rule: a slow but steady
           upload is fine, a drip is not)
    APP    the request is whole; the app answers: no deadline of ours (the request timeout runs)

A cut connection gets a 408 in OpenAI form where a response can still be written, then is
closed; the app reading a cut body sees a disconnect. Beyond ``max_connections`` open
connections a new one gets a 503 and is closed at once. The hot path pays nothing: a whole
request in one read arms no timer, and each connection arms one at its start (for a client
that never sends); a timer that fires early re-arms itself for what is left. Both protocols
uvicorn may run keep these limits: httptools (a dependency, the default) and h11 (the fallback).
"""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from shmgate.gateway.config import LimitOptions
from shmgate.gateway.http_errors import error_body
from shmgate.shared.errors import RequestError

__all__ = ["MAX_HEAD_BYTES", "ConnectionLimits", "http_protocol", "read_capped"]

MAX_HEAD_BYTES = 1 << 20


_DECLARED = LimitOptions()


@dataclass(frozen=True)
class ConnectionLimits:
    """How slow a client may be, and how many may be connected to one frontend at once."""

    # the defaults are the flags' (gateway/config.py LimitOptions), written there once
    header_timeout_s: float = _DECLARED.header_timeout_s  # a request head must be whole this long after it may start
    body_timeout_s: float = _DECLARED.body_timeout_s  # a body gets this long, plus a second per body_min_rate bytes
    body_min_rate: float = _DECLARED.body_min_rate  # bytes per second
    max_connections: int = _DECLARED.max_connections  # open connections per frontend; beyond, a 503 and close


class _Phase(enum.Enum):
    HEAD = "head"  # waiting for a request head: header_timeout_s runs from the phase's start
    BODY = "body"  # the head is complete, the body arrives: body_timeout_s plus the rate allowance
    APP = "app"  # the request is whole and the app answers it: no deadline here


def _closing_response(
    status: bytes, message: str, code: str, error_type: str = "invalid_request_error", extra_headers: bytes = b""
) -> bytes:
    """A complete HTTP/1.1 response carrying an OpenAI error object, after which we close."""
    body = json.dumps(error_body(message, error_type, code)).encode()
    head = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%sconnection: close\r\n\r\n"
    return head % (status, len(body), extra_headers) + body


_TOO_LARGE = _closing_response(
    b"431 Request Header Fields Too Large",
    f"the request line and headers are larger than {MAX_HEAD_BYTES} bytes",
    "headers_too_large",
)
_UNPARSABLE = _closing_response(b"400 Bad Request", "the HTTP request could not be parsed", "invalid_http")


_TOO_MANY = _closing_response(
    b"503 Service Unavailable",
    "too many open connections to this server; retry shortly",
    "too_many_connections",
    "server_error",
    b"retry-after: 1\r\n",
)


class _ClientDeadlines:
    """The phase clock of one connection, shared by the httptools and h11 protocols below.

    It comes first in each protocol's bases, so its ``connection_made`` and ``connection_lost`` wrap the
    server protocol's; a protocol calls ``_enter`` on each phase change and ``_after_data`` after each
    read; the rest is here.
    """

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._open_or_refuse(transport)  # type: ignore[arg-type]  # a server's connections are Transports

    def connection_lost(self, exc: Exception | None) -> None:
        self._close_deadlines()
        super().connection_lost(exc)  # type: ignore[misc]

    limits = ConnectionLimits()
    transport: Any
    loop: Any
    cycle: Any
    connections: Any
    _phase = _Phase.HEAD
    _phase_started = 0.0  # loop time
    _body_bytes = 0
    _idle_kept_alive = False  # HEAD after a response with no byte of a next request yet: uvicorn's keep-alive
    _deadline: asyncio.TimerHandle | None = None

    def _open_or_refuse(self, transport: asyncio.Transport) -> None:
        """Count the connection against the cap (a 503 and close beyond it), or start its head clock."""
        if len(self.connections) > self.limits.max_connections:
            transport.write(_TOO_MANY)
            transport.close()
            return
        self._phase_started = self.loop.time()
        self._arm(self.limits.header_timeout_s)  # a client that never sends a byte

    def _close_deadlines(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _enter(self, phase: _Phase, *, kept_alive: bool = False) -> None:
        self._phase, self._phase_started, self._body_bytes = phase, self.loop.time(), 0
        self._idle_kept_alive = kept_alive

    def _after_data(self) -> None:
        """After a read: a partial head or body has its clock running (a whole request arms nothing)."""
        self._idle_kept_alive = False
        if self._phase is not _Phase.APP and self._deadline is None and not self.transport.is_closing():
            self._arm(self._time_left())

    def _time_left(self) -> float:
        if self._phase is _Phase.HEAD:
            allowed = self.limits.header_timeout_s
        else:
            allowed = self.limits.body_timeout_s + self._body_bytes / self.limits.body_min_rate
        return self._phase_started + allowed - self.loop.time()

    def _arm(self, delay_s: float) -> None:
        self._deadline = self.loop.call_later(max(0.0, delay_s), self._on_deadline)

    def _on_deadline(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self._phase is _Phase.APP or self._idle_kept_alive:
            return  # (an idle keep-alive connection is uvicorn's to close, silently: data re-arms us)
        left = self._time_left()
        if left > 0:
            self._arm(left)  # the phase started again since this timer was armed, or the body kept coming
            return
        self._cut()

    def _cut(self) -> None:
        """Answer 408 where a response can still be written, and close; the app reading a body sees a disconnect."""
        cycle = self.cycle
        if self._phase is _Phase.HEAD or cycle is None or not cycle.response_started:
            self.transport.write(_too_slow(self._phase, self.limits))
        if self._phase is _Phase.BODY and cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # its send() writes nothing more; receive() says http.disconnect
            cycle.message_event.set()
        self.transport.close()


def _too_slow(phase: _Phase, limits: ConnectionLimits) -> bytes:
    if phase is _Phase.HEAD:
        message = f"the request line and headers did not arrive within {limits.header_timeout_s:g} s"
    else:
        message = (
            f"the request body arrived too slowly (it gets {limits.body_timeout_s:g} s, "
            f"plus 1 s per {limits.body_min_rate:g} bytes received)"
        )
    return _closing_response(b"408 Request Timeout", message, "request_timeout")


def http_protocol(
    limits: ConnectionLimits = ConnectionLimits(), *, prefer: str = "httptools"
) -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``: bounded httptools, else (or with ``prefer="h11"``) h11."""
    if prefer == "httptools":
        try:
            return _httptools_protocol(limits)
        except ImportError:  # httptools is a dependency; without it, h11 (slower, same limits)
            pass
    return _h11_protocol(limits)


def _httptools_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpToolsProtocol(_ClientDeadlines, HttpToolsProtocol):
        _head_bytes = 0
        _in_head = True  # from the connection's start or a message's end until headers are complete

        def on_headers_complete(self) -> None:
            authority = absolute_form_host(self.url)
            if authority is not None:
                # in place: the scope built at the message's start holds this very list
                self.headers[:] = [(n, v) for n, v in self.headers if n != b"host"] + [(b"host", authority)]
            self._in_head = False
            self._head_bytes = 0
            self._enter(_Phase.BODY)
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self._body_bytes += len(body)
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._in_head = True
            self._phase = _Phase.APP
            super().on_message_complete()

        def on_response_complete(self) -> None:
            # The next head's clock starts now, unless a pipelined request is already being read or answered.
            if self._phase is _Phase.APP and not self.pipeline:
                self._enter(_Phase.HEAD, kept_alive=True)
            super().on_response_complete()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                return
            self._after_data()
            if not self._in_head:
                return
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self.transport.write(_TOO_LARGE)
                self.transport.close()

        def send_400_response(self, msg: str) -> None:  # httptools could not parse the request
            self.transport.write(_UNPARSABLE)
            self.transport.close()

    BoundedHttpToolsProtocol.limits = limits
    return BoundedHttpToolsProtocol


def _h11_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """h11 bounds the head itself (``max_incomplete_event_size``, 16 KiB); this adds the deadlines and the cap.

    h11 gives no callback per event, so the phase is read off its state after each read:
    IDLE is a head being awaited, SEND_BODY a body arriving, anything else a whole request.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    def phase_of(state: object) -> _Phase:
        return _Phase.HEAD if state is h11.IDLE else _Phase.BODY if state is h11.SEND_BODY else _Phase.APP

    class SlowClientH11Protocol(_ClientDeadlines, H11Protocol):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            phase = phase_of(self.conn.their_state)
            if phase is not self._phase:
                self._enter(phase)
            elif phase is _Phase.BODY:
                self._body_bytes += len(data)
            self._after_data()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            phase = phase_of(self.conn.their_state)
            if phase is not self._phase or phase is _Phase.HEAD:
                self._enter(phase, kept_alive=phase is _Phase.HEAD)

    SlowClientH11Protocol.limits = limits
    return SlowClientH11Protocol


def absolute_form_host(target: bytes) -> bytes | None:
    """The authority of an absolute-form request target (``http://host:port/path``), or None for the
    usual origin form (``/path``) and ``*``. An authority with userinfo (``user@host``) is returned whole,
    so the Host check refuses it."""
    if target.startswith((b"/", b"*")):
        return None
    scheme, sep, rest = target.partition(b"://")
    if not sep:
        return target  # not a URL at all: the Host check refuses it as a host value
    return rest.split(b"/", 1)[0].split(b"?", 1)[0]


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
