"""Opt-in http(s) image URLs: the address rules, the fetch's caps and pinning, and the served answers.

All traffic goes to 127.0.0.1 (tests/image_host.py). Host names that resolve to private
ranges are checked through an injected resolver: the fetch refuses them before connecting,
so no packet ever leaves this host.
"""

from __future__ import annotations

import asyncio
import ipaddress
import shutil
import ssl
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from shmgate.gateway.addresses import AddressKind, AllowList, IPAddress, classify
from shmgate.gateway.fetch import USER_AGENT, FetchPolicy, fetch_image
from shmgate.shared.errors import (
    ImageTooLarge,
    ImageURLForbidden,
    ImageURLTimeout,
    InvalidImageURL,
)
from tests.conftest import _serve
from tests.image_host import ImageHost, Route, self_signed, serve_images
from tests.serving import IMAGES, Server, image_request

PHOTO = (IMAGES / "camera_640.jpg").read_bytes()
LOCAL = AllowList.parse("127.0.0.1/32")
CAP = 256 << 10  # bytes; every photo in tests/data/images is smaller

# -- the address classifier -------------------------------------------------------------------

A = AddressKind
CLASSIFIED = [
    ("8.8.8.8", A.PUBLIC),
    ("1.1.1.1", A.PUBLIC),
    ("100.63.255.255", A.PUBLIC),
    ("100.128.0.0", A.PUBLIC),
    ("172.15.255.255", A.PUBLIC),
    ("172.32.0.0", A.PUBLIC),
    ("223.255.255.255", A.PUBLIC),
    ("0.0.0.0", A.UNSPECIFIED),
    ("0.1.2.3", A.RESERVED),
    ("127.0.0.1", A.LOOPBACK),
    ("127.255.255.254", A.LOOPBACK),
    ("10.0.0.1", A.PRIVATE),
    ("172.16.0.1", A.PRIVATE),
    ("172.31.255.255", A.PRIVATE),
    ("192.168.1.1", A.PRIVATE),
    ("100.64.0.1", A.PRIVATE),
    ("169.254.169.254", A.LINK_LOCAL),
    ("224.0.0.1", A.MULTICAST),
    ("239.255.255.250", A.MULTICAST),
    ("192.0.2.1", A.RESERVED),
    ("198.18.0.1", A.RESERVED),
    ("240.0.0.1", A.RESERVED),
    ("255.255.255.255", A.RESERVED),
    ("192.0.0.8", A.RESERVED),
    ("2606:4700:4700::1111", A.PUBLIC),
    ("2001:4860:4860::8888", A.PUBLIC),
    ("::", A.UNSPECIFIED),
    ("::1", A.LOOPBACK),
    ("fe80::1", A.LINK_LOCAL),
    ("fc00::1", A.PRIVATE),
    ("fd12:3456::1", A.PRIVATE),
    ("fec0::1", A.PRIVATE),
    ("ff02::1", A.MULTICAST),
    ("2001:db8::1", A.RESERVED),
    ("2001::1", A.RESERVED),
    ("100::1", A.RESERVED),
    ("4000::1", A.RESERVED),
    ("::127.0.0.1", A.RESERVED),  # IPv4-compatible (deprecated)
    # IPv6 forms that deliver to an IPv4 host are judged by that host
    ("::ffff:127.0.0.1", A.LOOPBACK),
    ("::ffff:10.1.2.3", A.PRIVATE),
    ("::ffff:169.254.169.254", A.LINK_LOCAL),
    ("::ffff:8.8.8.8", A.PUBLIC),
    ("64:ff9b::7f00:1", A.LOOPBACK),
    ("64:ff9b::a00:1", A.PRIVATE),
    ("64:ff9b::808:808", A.PUBLIC),
    ("64:ff9b:1::1", A.PRIVATE),
    ("2002:7f00:1::1", A.LOOPBACK),
    ("2002:a9fe:a9fe::", A.LINK_LOCAL),
    ("2002:808:808::1", A.PUBLIC),
]


@pytest.mark.parametrize(("text", "kind"), CLASSIFIED)
def test_address_is_classified_by_the_registry(text: str, kind: AddressKind) -> None:
    assert classify(ipaddress.ip_address(text)) is kind


def test_scoped_ipv6_address_is_link_local() -> None:
    assert classify(ipaddress.ip_address("2001:4860::1%eth0")) is A.LINK_LOCAL


def test_allow_list_matches_cidrs_names_and_mapped_forms() -> None:
    allow = AllowList.parse(" 10.1.0.0/16, 127.0.0.1 ,Images.Internal., fd00::/8,,")
    ip = ipaddress.ip_address
    assert allow.permits("x", ip("10.1.200.3")) and not allow.permits("x", ip("10.2.0.1"))
    assert allow.permits("x", ip("127.0.0.1")) and not allow.permits("x", ip("127.0.0.2"))
    assert allow.permits("x", ip("::ffff:127.0.0.1"))  # the same socket as 127.0.0.1
    assert allow.permits("x", ip("fd00::5")) and not allow.permits("x", ip("fe80::1"))
    assert allow.permits("images.internal", ip("10.9.9.9")) and allow.permits("IMAGES.internal.", ip("::1"))
    assert not allow.permits("other.internal", ip("10.9.9.9"))
    assert not AllowList.parse("") and AllowList.parse("::1")


@pytest.mark.parametrize("entry", ["10.0.0.0/33", "bad host", "a..b", "10.1", "http://x", "-x.com"])
def test_allow_list_rejects_malformed_entries(entry: str) -> None:
    with pytest.raises(ValueError, match="allow-list entry"):
        AllowList.parse(entry)


# -- the fetch, against a local server -----------------------------------------------------------


def fetch(
    url: str,
    allow: AllowList = LOCAL,
    *,
    timeout_s: float = 5.0,
    resolve: Any = None,
    ssl_context: ssl.SSLContext | None = None,
) -> bytes:
    policy = FetchPolicy(allowlist=allow, max_bytes=CAP, timeout_s=timeout_s)
    kwargs: dict[str, Any] = {"ssl_context": ssl_context}
    if resolve is not None:
        kwargs["resolve"] = resolve
    return asyncio.run(fetch_image(url, policy, **kwargs))


class FakeDNS:
    """An injected resolver: a fixed table, and a log of what was asked (to show pinning)."""

    def __init__(self, table: dict[str, Sequence[str]]) -> None:
        self.table = {name: [ipaddress.ip_address(a) for a in addresses] for name, addresses in table.items()}
        self.asked: list[str] = []

    async def __call__(self, host: str, port: int) -> Sequence[IPAddress]:
        self.asked.append(host)
        return self.table.get(host, [])


@pytest.fixture(scope="module")
def image_host() -> Iterator[ImageHost]:
    with serve_images() as host:
        host.routes.update(
            {
                "/photo.jpg": Route(body=PHOTO, headers={"Content-Type": "image/jpeg", "Set-Cookie": "s=1"}),
                "/r1": Route(302, headers={"Location": "/r2", "Set-Cookie": "track=1"}),
                "/r2": Route(301, headers={"Location": "/photo.jpg"}),
                "/loop": Route(302, headers={"Location": "/loop"}),
                "/to-internal": Route(302, headers={"Location": "http://internal.test/photo.jpg"}),
                "/to-literal": Route(307, headers={"Location": f"http://127.0.0.1:{host.port}/photo.jpg"}),
                "/to-unspecified": Route(307, headers={"Location": f"http://0.0.0.0:{host.port}/photo.jpg"}),
                "/to-file": Route(302, headers={"Location": "file:///etc/passwd"}),
                "/no-location": Route(302),
                "/big": Route(body=b"\xff" * (CAP + 1)),
                "/big-unannounced": Route(body=b"\xff" * (4 * CAP), send_length=False),
                "/stall": Route(body=PHOTO, stall=True),
                "/missing": Route(404, b"gone"),
                "/text": Route(body=b"<html>not an image</html>", headers={"Content-Type": "text/html"}),
            }
        )
        yield host


def test_allow_listed_local_url_returns_the_bytes_with_our_headers(image_host: ImageHost) -> None:
    assert fetch(image_host.url("/photo.jpg")) == PHOTO
    seen = image_host.seen[-1]
    assert seen.headers["user-agent"] == USER_AGENT
    assert seen.headers["host"] == f"127.0.0.1:{image_host.port}"
    assert seen.headers["accept-encoding"] == "identity"


def test_loopback_without_allow_list_is_refused_before_connecting(image_host: ImageHost) -> None:
    before = len(image_host.seen)
    shorthand = ("2130706433", "0x7f.1", "127.1")  # the system resolver reads these as 127.0.0.1
    for url in (
        image_host.url("/photo.jpg"),
        image_host.url("/photo.jpg", "[::ffff:127.0.0.1]"),
        image_host.url("/photo.jpg", "localhost"),
        *(image_host.url("/photo.jpg", h) for h in shorthand),
    ):
        with pytest.raises(ImageURLForbidden, match="loopback"):
            fetch(url, AllowList())
    assert len(image_host.seen) == before


def test_private_and_metadata_addresses_are_refused_before_connecting() -> None:
    # A resolver answer whose first address is allowed is refused for its second one: ANY counts.
    # (A first address other than 127.0.0.1 would be contacted if this rule broke.)
    dns = FakeDNS(
        {
            "internal.test": ["10.0.0.7"],
            "mixed.test": ["127.0.0.1", "192.168.0.3"],
            "mixed6.test": ["127.0.0.1", "fd00::1"],
        }
    )
    for url, kind in [
        ("http://internal.test/a.jpg", "private"),
        ("https://mixed.test/a.jpg", "private"),
        ("http://mixed6.test/a.jpg", "private"),
        ("http://0.0.0.0/a.jpg", "unspecified"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ]:
        with pytest.raises(ImageURLForbidden, match=kind):
            fetch(url, resolve=dns)
    assert dns.asked == ["internal.test", "mixed.test", "mixed6.test"]  # a literal is never resolved


def test_a_name_is_resolved_once_and_the_connection_pinned_to_the_checked_address(image_host: ImageHost) -> None:
    dns = FakeDNS({"images.test": ["127.0.0.1"]})  # no real resolver knows this name
    assert fetch(image_host.url("/r1", "images.test"), resolve=dns) == PHOTO
    assert dns.asked == ["images.test"] * 3  # once per hop, by us; never by the HTTP client
    assert [s.headers["host"] for s in image_host.seen[-3:]] == [f"images.test:{image_host.port}"] * 3
    assert all("cookie" not in s.headers for s in image_host.seen[-3:])  # r1 set one


@pytest.mark.parametrize(
    ("path", "error", "match"),
    [
        ("/to-internal", ImageURLForbidden, "private"),
        ("/to-literal", ImageURLForbidden, "loopback"),  # 127.0.0.1 is allowed by name only, not by address
        ("/to-file", ImageURLForbidden, "only http and https"),
        ("/loop", InvalidImageURL, "redirected more than 5 times"),
        ("/no-location", InvalidImageURL, "without a Location"),
    ],
)
def test_every_redirect_hop_is_checked(image_host: ImageHost, path: str, error: type[Exception], match: str) -> None:
    dns = FakeDNS({"images.test": ["127.0.0.1"], "internal.test": ["10.0.0.7"]})
    before = len(image_host.seen)
    with pytest.raises(error, match=match):
        fetch(image_host.url(path, "images.test"), AllowList.parse("images.test"), resolve=dns)
    assert "/photo.jpg" not in image_host.paths()[before:]


@pytest.mark.parametrize(
    "url", ["ftp://127.0.0.1/a.jpg", "file:///etc/passwd", "http://user:pw@127.0.0.1/a.jpg", "gopher://127.0.0.1:70/"]
)
def test_other_schemes_and_credentials_are_forbidden(url: str) -> None:
    with pytest.raises(ImageURLForbidden):
        fetch(url)


@pytest.mark.parametrize("path", ["/big", "/big-unannounced"])
def test_a_body_over_the_cap_is_cut(image_host: ImageHost, path: str) -> None:
    with pytest.raises(ImageTooLarge, match=str(CAP)):
        fetch(image_host.url(path))


def test_a_stalled_server_is_cut_at_the_deadline(image_host: ImageHost) -> None:
    with pytest.raises(ImageURLTimeout, match="longer than 0.5 s"):
        fetch(image_host.url("/stall"), timeout_s=0.5)


def test_non_2xx_and_refused_connections_are_invalid_urls(image_host: ImageHost) -> None:
    with pytest.raises(InvalidImageURL, match="HTTP 404"):
        fetch(image_host.url("/missing"))
    with pytest.raises(InvalidImageURL, match="refused"):
        fetch("http://127.0.0.1:1/a.jpg")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_is_pinned_yet_verified_against_the_name(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path, "images.test")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    trust = ssl.create_default_context(cafile=str(cert))
    dns = FakeDNS({"images.test": ["127.0.0.1"], "impostor.test": ["127.0.0.1"]})
    with serve_images(tls) as host:
        host.routes["/photo.jpg"] = Route(body=PHOTO)
        assert fetch(host.url("/photo.jpg", "images.test"), resolve=dns, ssl_context=trust) == PHOTO
        with pytest.raises(InvalidImageURL, match="TLS"):  # same address, name not on the certificate
            fetch(host.url("/photo.jpg", "impostor.test"), resolve=dns, ssl_context=trust)
        with pytest.raises(InvalidImageURL, match="TLS"):  # the default CA bundle does not know our CA
            fetch(host.url("/photo.jpg", "images.test"), resolve=dns)


# -- configuration -----------------------------------------------------------------------------


def test_env_settings_reach_the_frontend_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    from shmgate.gateway.config import FrontendConfig
    from shmgate.node.cli import build_parser, parse_config
    from shmgate.node.plan import declared_models, frontend_config
    from shmgate.shared.options import decode, encode

    monkeypatch.setenv("SHMGATE_ALLOW_IMAGE_URLS", "1")
    monkeypatch.setenv("SHMGATE_IMAGE_URL_ALLOWLIST", "10.0.0.0/8,images.internal")
    monkeypatch.setenv("SHMGATE_IMAGE_URL_MAX_BYTES", "3MiB")
    monkeypatch.setenv("SHMGATE_IMAGE_URL_TIMEOUT_S", "2.5")
    serve = parse_config(["serve"])
    text = encode(frontend_config(serve, declared_models(serve), "0" * 16, 0, 3))
    for name in (
        "SHMGATE_ALLOW_IMAGE_URLS",
        "SHMGATE_IMAGE_URL_ALLOWLIST",
        "SHMGATE_IMAGE_URL_MAX_BYTES",
        "SHMGATE_IMAGE_URL_TIMEOUT_S",
    ):
        monkeypatch.delenv(name)  # the frontend must get them from its configuration alone
    frontend = decode(FrontendConfig, text).options.image_urls
    assert frontend.allow_image_urls is True
    assert AllowList.parse(frontend.image_url_allowlist) == AllowList.parse("images.internal,10.0.0.0/8")
    assert (frontend.image_url_max_bytes, frontend.image_url_timeout_s) == (3 << 20, 2.5)
    assert build_parser().parse_args(["serve"]).allow_image_urls is False  # off by default


def test_a_malformed_allow_list_stops_the_command_at_parse_time() -> None:
    from shmgate.node.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--image-url-allowlist", "10.0.0.0/33"])


# -- through a real server ---------------------------------------------------------------------


# Small queues (--queue-depth 2) and one server at a time: POSIX message queue memory is a
# per-user limit (ulimit -q) shared with every other test running on the machine.
SERVE = ("--workers", "1", "--frontends", "1", "--queue-depth", "2")


@pytest.fixture
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve("checksum", tmp_path_factory, *SERVE)


@pytest.fixture
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """URLs switched on with no allow-list: public addresses only."""
    yield from _serve("checksum", tmp_path_factory, *SERVE, "--allow-image-urls")


@pytest.fixture(scope="module")
def url_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(
        "checksum",
        tmp_path_factory,
        *SERVE,
        "--allow-image-urls",
        "--image-url-allowlist",
        "127.0.0.1/32",
        "--image-url-max-bytes",
        str(CAP),
        "--image-url-timeout-s",
        "2",
    )


def url_request(url: str, *, stream: bool = False) -> dict[str, Any]:
    body = image_request("checksum", PHOTO, stream=stream)
    body["messages"][0]["content"][1]["image_url"]["url"] = url  # type: ignore[index]
    return body


def post(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_urls_are_refused_by_default(default_server: Server, image_host: ImageHost) -> None:
    before = len(image_host.seen)
    response = post(default_server, url_request(image_host.url("/photo.jpg")))
    assert response.status_code == 400
    assert error_of(response)["param"] == "messages[0].content[1].image_url"
    assert "--allow-image-urls" in error_of(response)["message"]  # what the operator could change
    assert len(image_host.seen) == before


def test_switched_on_without_allow_list_loopback_is_refused(open_server: Server, image_host: ImageHost) -> None:
    before = len(image_host.seen)
    response = post(open_server, url_request(image_host.url("/photo.jpg")))
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "image_url_forbidden" and error["param"] == "messages[0].content[1].image_url"
    assert "127.0.0.1" in error["message"] and "shmgate" not in error["message"]  # the host, no IPC names
    assert len(image_host.seen) == before


def test_an_allow_listed_url_answers_like_the_data_url(url_server: Server, image_host: ImageHost) -> None:
    by_url = post(url_server, url_request(image_host.url("/r1")))  # first: the cache cannot answer for it
    by_data = post(url_server, image_request("checksum", PHOTO))
    assert by_url.status_code == by_data.status_code == 200, by_url.text
    assert by_url.json()["choices"][0]["message"] == by_data.json()["choices"][0]["message"]
    streamed = post(url_server, url_request(image_host.url("/photo.jpg"), stream=True))
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text


def test_a_data_url_and_an_image_url_mix_in_one_request(url_server: Server, image_host: ImageHost) -> None:
    other = (IMAGES / "coffee_640.jpg").read_bytes()
    mixed = image_request("checksum", other)
    mixed["messages"][0]["content"].append(  # type: ignore[index, union-attr]
        {"type": "image_url", "image_url": {"url": image_host.url("/photo.jpg")}}
    )
    both = post(url_server, mixed)
    assert both.status_code == 200, both.text
    assert len(both.json()["choices"][0]["message"]["content"].split("blake2b")) == 3  # two images hashed


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/to-unspecified", 400, "image_url_forbidden"),
        ("/big", 413, "image_too_large"),
        ("/big-unannounced", 413, "image_too_large"),
        ("/stall", 400, "image_url_timeout"),
        ("/missing", 400, "invalid_image_url"),
        ("/text", 400, "invalid_image"),
    ],
)
def test_fetch_failures_are_openai_errors(
    url_server: Server, image_host: ImageHost, path: str, status: int, code: str
) -> None:
    response = post(url_server, url_request(image_host.url(path)))
    assert response.status_code == status, response.text
    error = error_of(response)
    assert error["code"] == code
    assert error["param"] == "messages[0].content[1].image_url"  # fetch and decode errors name the image
    assert post(url_server, image_request("checksum", PHOTO)).status_code == 200  # and the server carries on
