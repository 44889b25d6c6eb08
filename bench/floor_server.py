"""The floors shmgate's own cost is measured against: the least a Python server can do per request.

``--decode`` (the decode floor): one uvicorn process running a bare ASGI app (no framework), which
decodes the body with one typed msgspec decoder, hands the image's base64 text to a process pool
(one process per core) that base64-decodes it, runs the project's own classifier preprocessing
(``gateway.preprocess.vision.ChecksumPreprocessor``: the same draft decode, resize and crop as
``shmgate serve --model checksum``) and digests the pixels as the checksum worker does; the answer
is the checksum backend's JSON. No shared memory, no queues, no batching, no cache, no limits: what
is left of shmgate's design when everything it adds is taken out.

``--no-decode`` (the HTTP floor): the same server, the same JSON decode of the whole body, and an
answer of the same size, but no base64, no image and no pool: what HTTP and JSON alone cost.

Why a process pool and not threads: Pillow releases the GIL while decoding, but base64, the digest
and the resize's Python glue do not; a pool is what a server that wants all its cores does, and it
pays for that with a pickled round trip per request, as shmgate pays with its descriptor.

Only for benchmarks (bench/gateway_cost.py): binds 127.0.0.1, answers 400 on anything it cannot
use, and has no limits of any kind. Usage: ``python bench/floor_server.py --port P [--no-decode]``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: the project's modules live in the repo root
    sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import uvicorn  # noqa: E402

MAX_PIXELS = 8192 * 8192
MODEL = "checksum"
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ImageURL(msgspec.Struct):
    url: str


class Part(msgspec.Struct):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class Message(msgspec.Struct):
    role: str
    content: str | list[Part] | None = None


class Chat(msgspec.Struct):
    model: str
    messages: list[Message]


_decoder = msgspec.json.Decoder(Chat)
_encoder = msgspec.json.Encoder()
_preprocessor: Any = None  # per pool process (_init_pool)


from shmgate.gateway.intake import strict_b64decode  # noqa: E402


def _init_pool() -> None:
    global _preprocessor
    from shmgate.gateway.preprocess.vision import ChecksumPreprocessor

    if _preprocessor is None:  # once per pool process (main() also calls this through the pool to start it)
        _preprocessor = ChecksumPreprocessor()
        threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """A pool process outlives a server killed with SIGKILL (it waits on its queue forever): leave with it."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def preprocess_and_digest(payload: str) -> str:
    """base64 text -> the checksum backend's answer for the image's pixels (runs in a pool process)."""
    data = strict_b64decode(payload)  # the gateway's base64 (SIMD when pybase64 is installed): the same cost
    arrays: list[np.ndarray] = []

    def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        arrays.append(np.empty(shape, dtype=dtype))
        return arrays[-1]

    _preprocessor.preprocess_image(data, allocate, max_pixels=MAX_PIXELS)
    return _answer(hashlib.blake2b(arrays[0].tobytes(), digest_size=16).hexdigest())


def _answer(digest: str) -> str:
    return json.dumps(
        {"tensors": [{"name": "pixels", "index": 0, "dtype": "uint8", "shape": [3, 224, 224], "blake2b": digest}]},
        separators=(",", ":"),
    )


def image_payload(chat: Chat) -> str:
    """The base64 text of the request's single data-URL image. Raises ValueError otherwise."""
    urls = [
        part.image_url.url
        for message in chat.messages
        if isinstance(message.content, list)
        for part in message.content
        if part.image_url is not None
    ]
    if len(urls) != 1:
        raise ValueError("send exactly one image_url part")
    header, sep, payload = urls[0].partition(",")
    if not sep or not header.startswith("data:") or not header.endswith(";base64"):
        raise ValueError("the image must be a base64 data URL")
    return payload


class FloorApp:
    """A bare ASGI app: POST /v1/chat/completions, GET /health, GET /v1/models."""

    def __init__(self, pool: ProcessPoolExecutor | None) -> None:
        self.pool = pool
        self.fixed_answer = _answer("0" * 32)  # --no-decode: the same size of answer, no work

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # uvicorn runs with lifespan="off"
            return
        path = scope["path"]
        if scope["method"] == "GET" and path == "/health":
            await _reply(send, 200, b'{"status":"ok"}')
        elif scope["method"] == "GET" and path == "/v1/models":
            await _reply(send, 200, _encoder.encode({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
        elif scope["method"] == "POST" and path == "/v1/chat/completions":
            await self.chat(receive, send)
        else:
            await _reply(send, 404, _error("not found"))

    async def chat(self, receive: Receive, send: Send) -> None:
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        try:
            chat = _decoder.decode(b"".join(chunks))
            payload = image_payload(chat)
            if self.pool is None:
                text = self.fixed_answer
            else:
                text = await asyncio.get_running_loop().run_in_executor(self.pool, preprocess_and_digest, payload)
        except Exception as exc:  # noqa: BLE001 - a floor answers every failure as a 400
            await _reply(send, 400, _error(str(exc)[:200]))
            return
        body = {
            "id": f"chatcmpl-{time.monotonic_ns()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": chat.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1},
        }
        await _reply(send, 200, _encoder.encode(body))


def _error(message: str) -> bytes:
    return _encoder.encode(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_request"}}
    )


async def _reply(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    parser.add_argument("--no-decode", action="store_true", help="the HTTP floor: parse and answer, no image work")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="decode pool size")
    args = parser.parse_args(argv)
    pool = None
    if not args.no_decode:
        pool = ProcessPoolExecutor(args.processes, initializer=_init_pool)
        for _ in range(args.processes):  # start the pool before the first request is timed
            pool.submit(_init_pool).result()
    try:
        uvicorn.run(
            FloorApp(pool), host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="off"
        )
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
