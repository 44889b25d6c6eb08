"""Fetch image bytes from a client's http(s) URL without opening a path into the network (SSRF).

Rules this module keeps (docs/SECURITY.md says why each one exists):
1. Only http and https URLs without userinfo are fetched; at most ``MAX_REDIRECTS`` redirects
   are followed, and every hop is checked exactly like the first.
2. Each hop's host is resolved once. If ANY of its addresses is not PUBLIC
   (gateway/addresses.py) and not allow-listed, the hop is refused before a connection opens.
3. The connection goes to the address that was checked: the URL's host is replaced by that
   IP, while the Host header, the TLS SNI and the certificate check keep the name. A DNS
   answer that changes between check and connect (rebinding) is therefore never used.
4. The body is streamed and cut at ``max_bytes``; a larger Content-Length is refused before
   reading. Only the identity encoding is asked for and nothing is decompressed, so the cap
   bounds both the bytes on the wire and the memory held.
5. One deadline, ``timeout_s``, covers resolution, connects, every redirect and the body.
6. GET only, no cookies, no proxy or CA settings from the environment, a fixed User-Agent.

Every failure is a RequestError (shared/errors.py): InvalidImageURL, ImageURLForbidden,
ImageURLTimeout or ImageTooLarge. Messages may name the URL's host but never an address it
resolved to, so error text does not map a private network for the caller.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import httpx

from shmgate.gateway.addresses import AddressKind, AllowList, IPAddress, classify
from shmgate.gateway.http_limits import read_capped
from shmgate.gateway.intake import GenerationRequest, PendingImageURL
from shmgate.shared.errors import (
    ImageTooLarge,
    ImageURLForbidden,
    ImageURLTimeout,
    InvalidImageURL,
    ShmgateError,
)

__all__ = ["MAX_REDIRECTS", "USER_AGENT", "FetchPolicy", "Resolver", "fetch_image", "fetch_pending", "resolve_host"]

USER_AGENT = "shmgate-image-fetch/0.1"
MAX_REDIRECTS = 5
MAX_URL_CHARS = 8192
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}

# (host, port) -> every address the host resolves to. Injected by tests, so that names
# resolving to private ranges can be checked without sending traffic anywhere.
Resolver = Callable[[str, int], Awaitable[Sequence[IPAddress]]]


@dataclass(frozen=True)
class FetchPolicy:
    """What ``--allow-image-urls`` and its companion flags configure (off unless given to the app)."""

    allowlist: AllowList = field(default_factory=AllowList)
    max_bytes: int = 20 << 20
    timeout_s: float = 10.0


async def resolve_host(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to, from the loop's getaddrinfo (a thread, not the loop)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise InvalidImageURL(f"the image URL's host {host!r} cannot be resolved") from None
    addresses: list[IPAddress] = []
    for *_, sockaddr in infos:
        address = ipaddress.ip_address(sockaddr[0])
        if address not in addresses:
            addresses.append(address)
    return addresses


async def fetch_image(
    url: str, policy: FetchPolicy, *, resolve: Resolver = resolve_host, ssl_context: ssl.SSLContext | None = None
) -> bytes:
    """The body of ``url`` under ``policy``'s rules (module docstring).

    ``ssl_context`` replaces the default CA bundle (tests pass one trusting their own CA).

    Raises:
        InvalidImageURL: malformed URL, unresolvable host, connection or protocol failure,
            a non-2xx answer, a redirect without Location, too many redirects.
        ImageURLForbidden: a scheme other than http(s), userinfo, or a refused address.
        ImageURLTimeout: the whole fetch took longer than ``policy.timeout_s``.
        ImageTooLarge: the body (declared or received) is larger than ``policy.max_bytes``.
    """
    first = _parse(url)
    context = ssl_context if ssl_context is not None else _default_ssl_context()
    try:
        return await asyncio.wait_for(_follow(first, policy, resolve, context), policy.timeout_s)
    except (TimeoutError, httpx.TimeoutException):
        raise ImageURLTimeout(
            f"fetching the image from {first.host!r} took longer than {policy.timeout_s:g} s"
        ) from None


async def fetch_pending(
    chat: GenerationRequest,
    policy: FetchPolicy,
    *,
    resolve: Resolver = resolve_host,
    ssl_context: ssl.SSLContext | None = None,
) -> GenerationRequest:
    """``chat`` with its image URLs fetched, concurrently, into its images; the first error wins.

    Called by the app between intake and submission, so fetched bytes take exactly the data
    URL path from there on. The other fetches are cancelled on the first failure, and all of
    them when the caller is cancelled (client gone).
    """
    pending = chat.pending_urls
    tasks = [
        asyncio.ensure_future(fetch_image(p.url, policy, resolve=resolve, ssl_context=ssl_context)) for p in pending
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for item, task in zip(pending, tasks):
        if not task.cancelled() and task.exception() is not None:
            raise _with_param(task.exception(), item)
    images = list(chat.images)
    for item, task in zip(pending, tasks):
        images[item.index] = task.result()
    return dataclasses.replace(chat, images=images, pending_urls=[])


def _with_param(exc: BaseException | None, item: PendingImageURL) -> BaseException:
    if isinstance(exc, ShmgateError) and exc.param is None:
        exc.param = item.param
    assert exc is not None
    return exc


async def _follow(url: httpx.URL, policy: FetchPolicy, resolve: Resolver, context: ssl.SSLContext) -> bytes:
    """Rules 1-4 and 6, hop by hop; the caller owns the deadline (rule 5)."""
    for _ in range(MAX_REDIRECTS + 1):
        address = await _check(url, policy.allowlist, resolve)
        transport = httpx.AsyncHTTPTransport(verify=context, trust_env=False, retries=0)
        async with httpx.AsyncClient(
            transport=transport, trust_env=False, follow_redirects=False, timeout=policy.timeout_s
        ) as client:  # a fresh client: no cookie jar
            try:
                response = await client.send(_pinned_request(client, url, address), stream=True)
                try:
                    if response.status_code in _REDIRECT_STATUSES:
                        url = _next_hop(url, response)
                        continue
                    if not 200 <= response.status_code < 300:
                        raise InvalidImageURL(
                            f"fetching the image from {url.host!r} returned HTTP {response.status_code}"
                        )
                    return await read_capped(
                        response.headers.get("content-length"),
                        response.aiter_raw(),
                        policy.max_bytes,
                        "the image",
                        ImageTooLarge,
                    )
                finally:
                    await response.aclose()
            except httpx.TimeoutException:
                raise
            except httpx.HTTPError as exc:
                raise InvalidImageURL(f"the image could not be fetched from {url.host!r}: {_reason(exc)}") from None
    raise InvalidImageURL(f"the image URL redirected more than {MAX_REDIRECTS} times")


def _parse(url: str) -> httpx.URL:
    """Rule 1 for one URL. Raises InvalidImageURL or ImageURLForbidden."""
    if len(url) > MAX_URL_CHARS:
        raise InvalidImageURL(f"the image URL is longer than {MAX_URL_CHARS} characters")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError):
        raise InvalidImageURL("the image URL is not a valid URL") from None
    if parsed.scheme not in _DEFAULT_PORTS:
        raise ImageURLForbidden(f"only http and https image URLs are fetched, not {parsed.scheme[:20]!r}")
    if parsed.userinfo:
        raise ImageURLForbidden("image URLs with credentials (user:password@host) are not fetched")
    if not parsed.raw_host:
        raise InvalidImageURL("the image URL has no host")
    return parsed.copy_with(fragment=None)


async def _check(url: httpx.URL, allowlist: AllowList, resolve: Resolver) -> IPAddress:
    """Rule 2: the address to connect to, once every address of the host passed."""
    host = url.raw_host.decode("ascii")
    try:
        addresses: Sequence[IPAddress] = [ipaddress.ip_address(host)]  # a literal is not resolved
    except ValueError:
        addresses = await resolve(host, url.port or _DEFAULT_PORTS[url.scheme])
    if not addresses:
        raise InvalidImageURL(f"the image URL's host {url.host!r} cannot be resolved")
    for address in addresses:
        kind = classify(address)
        if kind is not AddressKind.PUBLIC and not allowlist.permits(host, address):
            raise ImageURLForbidden(
                f"the image URL's host {url.host!r} resolves to a {kind.value} address; this server fetches "
                "images only from public addresses (its operator can allow more with --image-url-allowlist)"
            )
    return addresses[0]


def _pinned_request(client: httpx.AsyncClient, url: httpx.URL, address: IPAddress) -> httpx.Request:
    """Rule 3: connect to ``address`` while HTTP and TLS still see the URL's name."""
    host = url.raw_host.decode("ascii")
    extensions = {}
    if url.scheme == "https" and not _is_literal(host):
        extensions["sni_hostname"] = host  # SNI and certificate hostname check (httpcore)
    headers = {
        "Host": url.netloc.decode("ascii"),
        "User-Agent": USER_AGENT,
        "Accept": "image/*",
        "Accept-Encoding": "identity",
    }
    return client.build_request("GET", url.copy_with(host=str(address)), headers=headers, extensions=extensions)


def _next_hop(url: httpx.URL, response: httpx.Response) -> httpx.URL:
    location = response.headers.get("location")
    if not location:
        raise InvalidImageURL(f"{url.host!r} answered HTTP {response.status_code} without a Location")
    try:
        target = url.join(location)
    except (httpx.InvalidURL, ValueError, TypeError):
        raise InvalidImageURL(f"{url.host!r} redirected to an invalid URL") from None
    return _parse(str(target))


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _reason(exc: httpx.HTTPError) -> str:
    """A short cause for the client, without the socket details httpx's messages may carry."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLError):
            return "the TLS handshake or certificate check failed"
        cause = cause.__cause__ or cause.__context__
    if isinstance(exc, httpx.ConnectError):
        return "the connection was refused or failed"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "the server's answer is not valid HTTP"
    return "the connection failed while reading"


@functools.lru_cache(maxsize=1)
def _default_ssl_context() -> ssl.SSLContext:
    """Built once per process: loading the CA bundle costs tens of milliseconds."""
    return httpx.create_ssl_context(trust_env=False)
