"""What the guards in front of every route cost per request (gateway/guards.py: CatchAll + AllowedHosts).

    PYTHONPATH=. python bench/guards_cost.py

Runs a trivial ASGI app bare and behind both middlewares, in process (no sockets), and prints the
microseconds per request of each; the difference is what every request pays for the request id,
the catch-all and the Host check.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import Message, Receive, Scope, Send

from shmgate.gateway.guards import AllowedHosts, CatchAll

SCOPE: Scope = {
    "type": "http",
    "method": "GET",
    "path": "/health",
    "headers": [
        (b"host", b"127.0.0.1:8000"),
        (b"accept", b"*/*"),
        (b"user-agent", b"bench"),
        (b"content-type", b"application/json"),
    ],
}


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _receive() -> Message:
    return {"type": "http.request", "body": b""}


async def _send(message: Message) -> None:
    return None


async def _per_request_us(app: object, n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        await app(SCOPE, _receive, _send)  # type: ignore[operator]
    return (time.perf_counter() - started) / n * 1e6


async def main(n: int = 100_000, rounds: int = 3) -> None:
    guarded = CatchAll(AllowedHosts(_app, ("localhost", "127.0.0.1", "::1")), stats=lambda: None)
    for _ in range(rounds):
        bare, behind = await _per_request_us(_app, n), await _per_request_us(guarded, n)
        print(f"bare {bare:.2f} us/request, behind the guards {behind:.2f} us/request (+{behind - bare:.2f})")


if __name__ == "__main__":
    asyncio.run(main())
