"""What stands between the network and the routes: the catch-all, the Host check, the body's media type.

- ``CatchAll``: every request gets an ``x-request-id``; an exception no route turned into an
  OpenAI error becomes a ``500 internal_error`` naming that id, counted ``server_error``, logged
  as one line and its traceback once. The response is complete, so uvicorn keeps the keep-alive
  connection (Starlette's ``ServerErrorMiddleware`` answers in plain text and then re-raises, after
  which uvicorn drops the connection). A client that closed its connection mid-body
  (``ClientDisconnect``) is a cancelled request: counted ``cancelled``, one short log line.
- ``AllowedHosts``: the ``Host`` header must name this server. A gateway listening on loopback
  without an API key could otherwise be driven by any web page the developer opens, through DNS
  rebinding (the browser's same-origin check trusts the name, not the address). A request with
  no ``Host`` at all (an HTTP/1.0 probe) passes: browsers always send one.
- ``require_json``: request bodies are parsed only when sent as ``application/json`` (or with no
  Content-Type at all). ``text/plain``, form and multipart bodies are the ones a browser sends
  cross-site without a preflight, so refusing them keeps other origins from posting to us.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shmgate.gateway.http_errors import error_body, error_response
from shmgate.gateway.metrics import Counter, FrontendStats
from shmgate.shared.errors import HostNotAllowed, ShmgateError, UnsupportedMediaType

__all__ = [
    "ANY_HOST",
    "AllowedHosts",
    "CatchAll",
    "default_allowed_hosts",
    "parse_allowed_hosts",
    "require_json",
]

log = logging.getLogger("shmgate.gateway.guards")

ANY_HOST = "*"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_LOOPBACK_ADDRESSES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]", "ip6-localhost"})


# -- the catch-all --------------------------------------------------------------------------------------


class CatchAll:
    """Pure ASGI middleware: an ``x-request-id`` on every response, and a 500 in OpenAI form for any stray exception.

    ``stats`` returns the frontend's counters, or None before the lifespan attached them.
    """

    def __init__(self, app: ASGIApp, stats: Callable[[], FrontendStats | None]) -> None:
        self.app = app
        self.stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = secrets.token_hex(8)
        header = (b"x-request-id", request_id.encode())
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:
            self._count(Counter.CANCELLED)
            log.info(
                "request %s %s %s: the client closed the connection before sending the whole body",
                request_id,
                scope.get("method"),
                scope.get("path"),
            )
        except Exception:
            self._count(Counter.REQUESTS_SERVER_ERROR)
            log.exception(
                "request %s %s %s failed with an unexpected exception",
                request_id,
                scope.get("method"),
                scope.get("path"),
            )
            if started:  # a streamed answer broke off: nothing more can be said on this response
                return
            error = ShmgateError(f"internal error; quote request id {request_id} when reporting it")
            await error_response(error)(scope, receive, send_with_id)

    def _count(self, counter: Counter) -> None:
        stats = self.stats()
        if stats is not None:
            stats.add(counter)


# -- the Host header -------------------------------------------------------------------------------------


def parse_allowed_hosts(text: str) -> tuple[str, ...]:
    """``--allowed-hosts``: a comma list of host names (no ports); ``*`` allows any. Empty: the default."""
    return tuple(_host_name(part) for part in text.split(",") if part.strip())


def default_allowed_hosts(listen_host: str) -> tuple[str, ...]:
    """The loopback names when the gateway listens on a loopback address, else any host.

    Why: on loopback the only legitimate clients are on this machine and say ``localhost`` or an
    address; a browser tricked by DNS rebinding says the attacker's name. Listening on a routable
    address, the names clients use (a service name, a load balancer's) are not known here.
    """
    return LOOPBACK_HOSTS if _host_name(listen_host) in _LOOPBACK_ADDRESSES else (ANY_HOST,)


def _host_name(host: str) -> str:
    """``Host`` header or flag value -> its lower-case name without port or IPv6 brackets."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        return host.split(":", 1)[0]
    return host


class AllowedHosts:
    """Pure ASGI middleware answering a request whose ``Host`` is not allowed with a 421 in OpenAI form,
    counted ``client_error`` (``stats`` as for CatchAll)."""

    def __init__(
        self, app: ASGIApp, hosts: Iterable[str], stats: Callable[[], FrontendStats | None] = lambda: None
    ) -> None:
        self.app = app
        self.hosts = frozenset(_host_name(h) for h in hosts)
        self.any = ANY_HOST in self.hosts
        self.stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.any or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = ""
        for name, value in scope["headers"]:
            if name == b"host":
                host = value.decode("latin-1")
                break
        if not host or _host_name(host) in self.hosts:  # no Host (HTTP/1.0 probes): no name to rebind
            await self.app(scope, receive, send)
            return
        error = HostNotAllowed(
            "the Host header names a host this server does not answer for; "
            "use one of --allowed-hosts (by default the loopback names)"
        )
        stats = self.stats()
        if stats is not None:
            stats.add(Counter.REQUESTS_CLIENT_ERROR)
        await JSONResponse(
            error_body(error.message, error.error_type, error.code, "Host"), status_code=error.status_hint
        )(scope, receive, send)


# -- the body's media type --------------------------------------------------------------------------------


def require_json(content_type: str | None) -> None:
    """Raise UnsupportedMediaType unless ``content_type`` is absent or ``application/json`` (any parameters)."""
    if not content_type:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise UnsupportedMediaType(
            f"request bodies must be JSON; send 'Content-Type: application/json', not {media_type[:60]!r}"
        )
