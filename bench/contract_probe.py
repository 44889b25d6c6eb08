"""Probe a running gateway with the inputs that used to leave the error contract; print one line per probe.

    python bench/contract_probe.py http://127.0.0.1:8000

Each line: the probe, the status, the response's bytes and what else tells (a Location header, a
keep-alive connection kept or lost, the classifier's usage). Run it against two builds to compare
them (docs/SECURITY.md "Error contract and cross-site requests" has the figures).
"""

from __future__ import annotations

import base64
import json
import re
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx

CHAT = "/v1/chat/completions"
PHOTO = Path(__file__).parent.parent / "tests" / "data" / "images" / "coffee_640.jpg"


def _chat(model: str, **extra: object) -> dict[str, object]:
    """A request every model here answers with a 200 (the classifier needs an image)."""
    image = "data:image/jpeg;base64," + base64.b64encode(PHOTO.read_bytes()).decode()
    return {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": image}},
                ],
            }
        ],
        **extra,
    }


def _keep_alive(url: str, first: bytes) -> str:
    """Send ``first`` and then a GET /health on the same connection: was the second answered?"""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port or 80), timeout=30) as sock:
        sock.sendall(first)
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := sock.recv(1 << 16)):
            answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
        while length and len(body) < int(length.group(1)) and (chunk := sock.recv(1 << 16)):
            body += chunk
        try:
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode())
            kept = sock.recv(1 << 16).startswith(b"HTTP/1.1 200")
        except OSError:
            kept = False
    return "connection kept" if kept else "connection LOST"


def main(url: str) -> None:
    # One connection per request: a probe that breaks its connection must not fail the next probe.
    client = httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0))
    model = client.get("/v1/models").json()["data"][0]["id"]
    netloc = urlsplit(url).netloc

    def show(name: str, response: httpx.Response, extra: str = "") -> None:
        print(f"{name:44} {response.status_code}  {len(response.content):>9} B  {extra}")

    r = client.post(CHAT, json=_chat(model, logit_bias={"²": 1}))
    show("logit_bias {'²': 1}", r, r.headers.get("content-type", ""))
    bad_accept = (
        f"GET /metrics HTTP/1.1\r\nHost: {netloc}\r\nAccept: application/openmetrics-text; version=abc\r\n\r\n"
    ).encode()
    r = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=abc"})
    show("/metrics, Accept openmetrics version=abc", r, _keep_alive(url, bad_accept))
    r = client.post(CHAT, json={"model": model, "messages": [{"role": "r" * 1_000_000, "content": "hi"}]})
    show("a 1,000,000-character role", r)
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = client.post(
            CHAT,
            content=json.dumps(_chat(model)),
            headers={"Content-Type": content_type, "Origin": "http://evil.example"},
        )
        show(f"JSON body as {content_type.split(';')[0]}", r)
    r = client.post(CHAT, json=_chat(model), headers={"Host": "evil.example"})
    show("Host: evil.example", r)
    r = client.post(CHAT + "/", json=_chat(model))
    show("POST .../completions/ (trailing slash)", r, f"location={r.headers.get('location')}")
    for field, value in [
        ("guided_json", {"type": "object"}),
        ("guided_choice", ["a"]),
        ("structured_outputs", {"json": {}}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
    ]:
        r = client.post(CHAT, json=_chat(model, **{field: value}))
        show(f"{field}", r, str(r.json().get("error", {}).get("param", "")) if r.status_code != 200 else "")
    r = client.post(CHAT, json=_chat(model))
    show("an ordinary request", r)
    if model.startswith("efficientnet"):
        r = client.post(CHAT, json=_chat(model, max_tokens=1))
        answer = r.json()
        show(
            "classifier, max_tokens=1",
            r,
            f"completion_tokens={answer['usage']['completion_tokens']} "
            f"finish_reason={answer['choices'][0]['finish_reason']}",
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000")
