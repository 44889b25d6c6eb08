"""The naive baseline for a vision-language model: processing inside the model's process and thread.

What a plain server for a Hugging Face VLM does: one process, the model loaded once, and each
request's image decoding, image processor, chat template and tokenizer run right before its
generation, on the thread that owns the model. shmgate moves everything but the generation to
its frontends; bench/hf_processing.py measures the difference.

To be a fair baseline, not a straw man, it shares everything else with shmgate's HF path:
- the same code: ``gateway.preprocess.hf.HFPreprocessor`` (frontend half) and
  ``worker.backends.hf.HFBackend`` (worker half), so the tensors, token ids and greedy answers
  are identical to shmgate's;
- the same scheduling: one model thread (a single-thread executor) runs every step, and
  concurrent requests take turns per token, as a shmgate worker's round-robin batch does. HF
  models are not documented as safe to call from several threads at once, so a naive server
  either serialises like this or holds a lock for a whole request (worse for TTFT);
- real streaming: each generation step is awaited separately and its text is sent at once.

``GET /stats`` reports ``busy_s`` (time the model thread spent running anything) and
``processing_s`` (the part of it that was image + prompt processing): the counterpart of
shmgate's ``shmgate_worker_busy_seconds_total``.

Usage: ``python bench/naive_hf_server.py --port P --model-dir DIR [--threads N] [--device cpu|cuda]``.
Only for benchmarks: it binds 127.0.0.1 by default and has no limits of any kind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: the project's modules live in the repo root
    sys.path.insert(0, str(REPO))

import numpy as np
import torch
import uvicorn
from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from bench.naive_server import BadRequest, image_bytes
from shmgate.gateway.preprocess.hf import HFPreprocessor
from shmgate.shared.wire import SamplingParams
from shmgate.worker.backends.base import BackendEvent, WorkItem
from shmgate.worker.backends.hf import HFBackend

MAX_PIXELS = 8192 * 8192
T = TypeVar("T")


class ModelThread:
    """The one thread that owns the model; everything that touches it runs there, one call at a time."""

    def __init__(self, model_dir: str, threads: int, device: str = "cpu") -> None:
        self.preprocessor = HFPreprocessor(model_dir)
        self.backend = HFBackend(model_dir, torch.device(device), threads=threads)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="model")
        self.busy_s = 0.0
        self.processing_s = 0.0
        self._next_id = 0

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the model thread, counting its time as busy."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._timed, fn, args)

    def _timed(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.busy_s += time.perf_counter() - started

    def prepare(self, body: dict[str, Any]) -> Iterator[BackendEvent]:
        """Decode and process the image, render and tokenize the prompt: what shmgate's frontends do."""
        started = time.perf_counter()
        try:
            data = image_bytes(body)
            tensors: dict[str, list[torch.Tensor]] = {}

            def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
                array = np.empty(shape, dtype=dtype)
                tensors.setdefault(name, []).append(torch.from_numpy(array))
                return array

            try:
                self.preprocessor.preprocess_image(data, allocate, max_pixels=MAX_PIXELS)
                spec = {name: (t[0].numpy().dtype.name, tuple(t[0].shape)) for name, t in tensors.items()}
                prompt = self.preprocessor.build_prompt(_hf_messages(body), [spec])
            except Exception as exc:  # the project's UndecodableImage / InvalidRequest, or Pillow's own
                raise BadRequest(f"cannot use the request: {exc}") from exc
            self._next_id += 1
            item = WorkItem(self._next_id, tensors, _sampling(body), inline=prompt.inline)
            return self.backend.run([item])
        finally:
            self.processing_s += time.perf_counter() - started


def _hf_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI messages in Hugging Face chat-template form (images as ``{"type": "image"}``)."""
    out = []
    for message in body.get("messages") or ():
        content = message.get("content")
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        else:
            parts = [
                {"type": "image"} if p.get("type") == "image_url" else {"type": "text", "text": p.get("text", "")}
                for p in content or ()
            ]
        out.append({"role": message.get("role", "user"), "content": parts})
    return out


def _sampling(body: dict[str, Any]) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    stop = body.get("stop") or ()
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(body.get("temperature", 1.0)),
        top_p=float(body.get("top_p", 1.0)),
        seed=body.get("seed"),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
    )


async def _events(model: ModelThread, stream: Iterator[BackendEvent]) -> AsyncIterator[BackendEvent]:
    """The generation's events, each step run on the model thread (other requests' steps in between)."""
    while (event := await model.call(next, stream, None)) is not None:
        yield event


def create_app(model: ModelThread) -> FastAPI:
    app = FastAPI(openapi_url=None)
    name = model.preprocessor.model

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any] = Body(...)) -> Any:  # noqa: B008
        try:
            stream = await model.call(model.prepare, body)
        except BadRequest as exc:
            error = {"message": str(exc), "type": "invalid_request_error", "param": None, "code": "invalid_request"}
            return JSONResponse({"error": error}, status_code=400)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name}
        if body.get("stream"):
            return StreamingResponse(_sse(model, stream, base), media_type="text/event-stream")
        parts, final = [], None
        async for event in _events(model, stream):
            parts.append(event.text)
            final = event if event.finish_reason else final
        assert final is not None, "the backend ends every item with a finish event"
        usage = {
            "prompt_tokens": final.prompt_tokens,
            "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
        }
        message = {"role": "assistant", "content": "".join(parts)}
        return {
            **base,
            "object": "chat.completion",
            "usage": usage,
            "choices": [{"index": 0, "message": message, "finish_reason": final.finish_reason}],
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "naive"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> dict[str, float]:
        return {"busy_s": model.busy_s, "processing_s": model.processing_s}

    return app


async def _sse(model: ModelThread, stream: Iterator[BackendEvent], base: dict[str, Any]) -> AsyncIterator[str]:
    chunk = {**base, "object": "chat.completion.chunk"}
    async for event in _events(model, stream):
        if event.text:
            delta = {"index": 0, "delta": {"content": event.text}, "finish_reason": None}
            yield f"data: {json.dumps({**chunk, 'choices': [delta]})}\n\n"
        if event.finish_reason:
            done = {"index": 0, "delta": {}, "finish_reason": event.finish_reason}
            yield f"data: {json.dumps({**chunk, 'choices': [done]})}\n\n"
    yield "data: [DONE]\n\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the model's dtype: bfloat16 on CUDA)")
    args = parser.parse_args(argv)
    app = create_app(ModelThread(args.model_dir, args.threads, args.device))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
