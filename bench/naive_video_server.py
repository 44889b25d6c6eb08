"""The naive baseline for video: bench/naive_hf_server.py's one process, video decoding in the request path.

Each request's container probe, frame decode, resize and patching run on the model's own thread
right before its generation, as a one-process API server runs its processor. The code is shmgate's
(``HFPreprocessor.preprocess_video``), so tensors, prompts and answers are identical; only where it
runs differs. Usage: ``python bench/naive_video_server.py --port P --model-dir DIR [--threads N]``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

import numpy as np
import torch
import uvicorn

from bench.naive_hf_server import ModelThread, _sampling, create_app
from bench.naive_server import BadRequest
from shmgate.worker.backends.base import BackendEvent, WorkItem


class VideoModelThread(ModelThread):
    def prepare(self, body: dict[str, Any]) -> Iterator[BackendEvent]:
        import time

        started = time.perf_counter()
        try:
            tensors: dict[str, list[torch.Tensor]] = {}
            specs = []
            messages = []
            for message in body.get("messages") or ():
                parts = []
                for part in message.get("content") or ():
                    if part.get("type") != "video_url":
                        parts.append({"type": "text", "text": part.get("text", "")})
                        continue
                    data = base64.b64decode(part["video_url"]["url"].split(",", 1)[1])
                    spec: dict[str, Any] = {}

                    def allocate(
                        name: str, dtype: str, shape: tuple[int, ...], spec: dict[str, Any] = spec
                    ) -> np.ndarray:
                        array = np.empty(shape, dtype=dtype)
                        tensors.setdefault(name, []).append(torch.from_numpy(array))
                        spec[name] = (dtype, shape)
                        return array

                    try:
                        self.preprocessor.preprocess_video(data, allocate, lambda n: contextlib.nullcontext())
                    except Exception as exc:
                        raise BadRequest(f"cannot use the video: {exc}") from exc
                    specs.append(spec)
                    parts.append({"type": "video"})
                messages.append({"role": message.get("role", "user"), "content": parts})
            prompt = self.preprocessor.build_prompt(messages, specs)
            self._next_id += 1
            return self.backend.run([WorkItem(self._next_id, tensors, _sampling(body), inline=prompt.inline)])
        finally:
            self.processing_s += time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    app = create_app(VideoModelThread(args.model_dir, args.threads))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
