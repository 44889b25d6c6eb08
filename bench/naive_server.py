"""The naive baseline: one process, one FastAPI handler that does everything.

This is how a vision model is usually put behind an OpenAI-style endpoint: parse the request,
base64-decode the data URL, decode and preprocess the image, run the model on a batch of one and
answer, all inside the request handler. shmgate is measured against it, so it must be the fairest
(fastest) version of that design, not a straw man:

* the preprocessing and the model are the project's own (``gateway.preprocess.vision``,
  ``worker.backends``), so both servers do exactly the same work per image and give the same answers;
* no access log, no request validation models beyond a dict;
* the handler kind is a flag. ``thread`` (a plain ``def`` handler in FastAPI's threadpool) overlaps
  image decoding (Pillow releases the GIL) of concurrent requests; ``async`` (the work inline in an
  ``async def`` handler) serializes every request on the event loop. The default is the one measured
  faster on the bench machine (see ``DEFAULT_HANDLER``).

``POST /v1/embeddings`` (efficientnet mode) is the naive embedding server: the same handler shape,
one image per request (``input`` a data URL), the project's backend asked for its pooled features
(``WorkItem.task == "embed"``), answered as OpenAI's embedding list (float or base64).

Usage: ``python bench/naive_server.py --port P --mode checksum|efficientnet [--handler thread|async]``.
Only for benchmarks and tests: it binds 127.0.0.1 by default and has no limits of any kind.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: the project's modules live in the repo root
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import Body, FastAPI  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from shmgate.gateway.preprocess.vision import ChecksumPreprocessor, EfficientNetPreprocessor  # noqa: E402
from shmgate.worker.backends.base import ModelBackend, WorkItem  # noqa: E402

PREPROCESSORS = {"checksum": ChecksumPreprocessor, "efficientnet": EfficientNetPreprocessor}
MAX_PIXELS = 8192 * 8192  # generous: the naive server has no real bound, this only stops decompression bombs
# Measured on the 2-core bench machine (shared with other jobs, ~1 core busy elsewhere), 1024 px
# photos, 200 requests, req/s at concurrency 1 / 8 / 32. efficientnet: thread 17.9 / 24.4 / 19.7,
# async 2.1 / 1.9 / 1.6: inline on the event loop, torch's second OpenMP thread spins against the
# loop thread and the client (~290 ms of CPU per request instead of ~40); async with 1 torch thread
# reaches 18 / 19 but never beats thread. checksum: two rounds each, thread 114-151 / 65-162 /
# 83-88, async 42-72 / 43-142 / 40-100: within the noise, thread never clearly worse.
DEFAULT_HANDLER = "thread"


class BadRequest(Exception):
    """The request cannot be served; answered as an OpenAI-style 400."""


def make_backend(mode: str, threads: int) -> ModelBackend:
    """The project's backend for ``mode``, on the CPU. An explicit table, no import-by-string."""
    if mode == "efficientnet":
        from shmgate.worker.backends.efficientnet import EfficientNetBackend

        return EfficientNetBackend(torch.device("cpu"), threads=threads)
    from shmgate.worker.backends.checksum import ChecksumBackend

    return ChecksumBackend(torch.device("cpu"))


def image_bytes(body: dict[str, Any]) -> bytes:
    """The bytes of the single image of an OpenAI chat request (data URL only)."""
    urls = [
        part["image_url"]["url"] if isinstance(part.get("image_url"), dict) else part.get("image_url")
        for message in body.get("messages") or ()
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image_url"
    ]
    if len(urls) != 1 or not isinstance(urls[0], str):
        raise BadRequest("send exactly one image_url part")
    header, sep, payload = urls[0].partition(",")
    if not sep or not header.startswith("data:") or not header.endswith(";base64"):
        raise BadRequest("the image must be a base64 data URL")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise BadRequest(f"bad base64 in the data URL: {exc}") from exc


class NaiveModel:
    """Preprocessing plus backend, run for one image at a time in the caller's thread."""

    def __init__(self, mode: str, threads: int) -> None:
        self.preprocessor = PREPROCESSORS[mode]()
        self.model_id = self.preprocessor.model
        self.backend = make_backend(mode, threads)
        self.next_id = 0

    def answer(self, data: bytes, body: dict[str, Any]) -> tuple[str, int]:
        """(answer text, completion tokens) for one image."""
        parts: list[str] = []
        tokens = 0
        for event in self.backend.run([self._item(data, text=_user_text(body))]):
            parts.append(event.text)
            tokens += event.completion_tokens
        return "".join(parts), tokens

    def embed(self, data: bytes) -> bytes:
        """One image's unit-normalised embedding, little-endian float32 bytes."""
        vectors = [e.vector for e in self.backend.run([self._item(data, task="embed")]) if e.vector is not None]
        if not vectors:
            raise BadRequest(f"{self.model_id} does not produce embeddings")
        return vectors[0]

    def _item(self, data: bytes, *, text: str = "", task: str = "") -> WorkItem:
        """Preprocess one image into a work item for the backend."""
        tensors: dict[str, list[torch.Tensor]] = {}

        def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
            array = np.empty(shape, dtype=dtype)
            tensors.setdefault(name, []).append(torch.from_numpy(array))
            return array

        try:
            self.preprocessor.preprocess_image(data, allocate, max_pixels=MAX_PIXELS)
        except Exception as exc:  # the project's UndecodableImage / ImageTooLarge, or Pillow's own
            raise BadRequest(f"cannot use the image: {exc}") from exc
        self.next_id += 1
        return WorkItem(request_id=self.next_id, tensors=tensors, text=text, task=task)


def embedding_image(body: dict[str, Any]) -> bytes:
    """The bytes of the single image of an OpenAI embeddings request (``input``: one data URL)."""
    url = body.get("input")
    url = url[0] if isinstance(url, list) and len(url) == 1 else url
    if not isinstance(url, str):
        raise BadRequest("send one data URL as input")
    return image_bytes({"messages": [{"content": [{"type": "image_url", "image_url": {"url": url}}]}]})


def embedding_list(model: str, vector: bytes, encoding: str) -> dict[str, Any]:
    """OpenAI's embedding list for one vector."""
    value: Any = base64.b64encode(vector).decode() if encoding == "base64" else np.frombuffer(vector, "<f4").tolist()
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": value}],
        "model": model,
        "usage": {"prompt_tokens": 0, "total_tokens": 0},
    }


def _user_text(body: dict[str, Any]) -> str:
    return " ".join(
        part.get("text", "")
        for message in body.get("messages") or ()
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "text"
    )


def completion(model: str, text: str, tokens: int) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` object."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens},
    }


def chunks(model: str, text: str) -> Iterator[str]:
    """The SSE events of a streamed answer: one content chunk, the finish chunk, [DONE]."""
    base = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }
    yield f"data: {json.dumps({**base, 'choices': [{'index': 0, 'delta': {'role': 'assistant', 'content': text}, 'finish_reason': None}]})}\n\n"  # noqa: E501
    yield f"data: {json.dumps({**base, 'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
    yield "data: [DONE]\n\n"


def create_app(mode: str, handler: str, threads: int) -> FastAPI:
    """The app; ``handler`` picks ``def`` (threadpool) or ``async def`` (on the event loop)."""
    model = NaiveModel(mode, threads)
    app = FastAPI(openapi_url=None)

    def respond(body: dict[str, Any]) -> JSONResponse | StreamingResponse:
        try:
            text, tokens = model.answer(image_bytes(body), body)
        except BadRequest as exc:
            error = {"message": str(exc), "type": "invalid_request_error", "code": "invalid_request"}
            return JSONResponse({"error": error}, status_code=400)
        name = body.get("model") or model.model_id
        if body.get("stream"):
            return StreamingResponse(chunks(name, text), media_type="text/event-stream")
        return JSONResponse(completion(name, text, tokens))

    if handler == "async":

        @app.post("/v1/chat/completions")
        async def chat_async(body: dict[str, Any] = Body(...)) -> Any:  # noqa: B008
            return respond(body)  # blocks the event loop for the whole request, as naive apps do
    else:

        @app.post("/v1/chat/completions")
        def chat_thread(body: dict[str, Any] = Body(...)) -> Any:  # noqa: B008
            return respond(body)  # FastAPI runs plain def handlers in its threadpool

    def respond_embedding(body: dict[str, Any]) -> JSONResponse:
        try:
            vector = model.embed(embedding_image(body))
        except BadRequest as exc:
            error = {"message": str(exc), "type": "invalid_request_error", "code": "invalid_request"}
            return JSONResponse({"error": error}, status_code=400)
        return JSONResponse(
            embedding_list(body.get("model") or model.model_id, vector, body.get("encoding_format") or "float")
        )

    if handler == "async":

        @app.post("/v1/embeddings")
        async def embeddings_async(body: dict[str, Any] = Body(...)) -> Any:  # noqa: B008
            return respond_embedding(body)
    else:

        @app.post("/v1/embeddings")
        def embeddings_thread(body: dict[str, Any] = Body(...)) -> Any:  # noqa: B008
            return respond_embedding(body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model.model_id, "object": "model", "owned_by": "naive"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--mode", choices=sorted(PREPROCESSORS), default="checksum")
    parser.add_argument("--handler", choices=["thread", "async"], default=DEFAULT_HANDLER)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    app = create_app(args.mode, args.handler, args.threads)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
