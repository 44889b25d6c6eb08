"""FastAPI's per-request routing cost: ``add_api_route`` against a plain Starlette ``add_route``.

The chat route takes only the Request, so FastAPI's dependency solving and its endpoint wrapper
buy it nothing; this says what they cost, in-process, with the ASGI messages played by hand (no
sockets, no uvicorn): the same endpoint (read the body, answer a small JSON) on both apps,
alternated rounds, CPU per request.

Usage: ``python bench/route_cost.py [--requests 3000] [--rounds 6]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

SCOPE: dict[str, Any] = {
    "type": "http",
    "asgi": {"version": "3.0"},
    "http_version": "1.1",
    "method": "POST",
    "scheme": "http",
    "path": "/v1/chat/completions",
    "raw_path": b"/v1/chat/completions",
    "query_string": b"",
    "root_path": "",
    "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")],
    "client": ("127.0.0.1", 1),
    "server": ("127.0.0.1", 2),
}


async def endpoint(request: Request) -> Response:
    await request.body()
    return Response(b'{"ok":1}', media_type="application/json")


def app_with(kind: str) -> FastAPI:
    app = FastAPI()
    if kind == "fastapi":
        app.add_api_route("/v1/chat/completions", endpoint, methods=["POST"])
    else:
        app.add_route("/v1/chat/completions", endpoint, methods=["POST"])
    return app


async def receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"{}", "more_body": False}


async def send(message: dict[str, Any]) -> None:
    pass


async def cpu_per_request(app: FastAPI, requests: int) -> float:
    for _ in range(50):
        await app(dict(SCOPE), receive, send)
    started = time.process_time()
    for _ in range(requests):
        await app(dict(SCOPE), receive, send)
    return (time.process_time() - started) / requests


async def main(requests: int, rounds: int) -> None:
    apps = {kind: app_with(kind) for kind in ("fastapi", "starlette")}
    seen: dict[str, list[float]] = {kind: [] for kind in apps}
    for round_index in range(rounds):
        for kind in list(apps) if round_index % 2 == 0 else list(apps)[::-1]:
            seen[kind].append(await cpu_per_request(apps[kind], requests))
    for kind, values in seen.items():
        print(
            f"{kind:>9} route: {min(values) * 1e6:5.1f} µs CPU/request (least of {rounds}), "
            f"median {statistics.median(values) * 1e6:5.1f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.rounds))
