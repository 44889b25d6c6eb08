"""LitServe baseline: EfficientNet-Lite0 behind LitServe's OpenAI spec, with its best CPU settings.

It serves the same model with the same preprocessing as shmgate (the project's
``gateway.preprocess.vision`` and ``worker.backends.efficientnet``), so the comparison measures the
serving machinery, not the model code. Run it with the bench venv made by ``setup_litserve.sh``:

    bench/.venv-litserve/bin/python bench/litserve_server.py --port P

How LitServe 0.2.x runs this (read from its source): the API server process receives the request
into a pydantic ``ChatCompletionRequest`` (the whole data URL included) and pickles it onto a
multiprocessing queue; each inference worker collates up to ``max_batch_size`` requests waiting at
most ``batch_timeout``, runs ``decode_request`` per request (here: base64 + decode + preprocess),
then ``batch`` / ``predict`` / ``encode_response`` once for the batch. With the OpenAI spec the
worker loop is the streaming one, so ``predict`` is a generator yielding one list of answers per
step and ``encode_response`` turns each list into chat messages.

On a GPU (``--accelerator cuda``, bench/gpu.py) the model runs there and LitServe's workers still
decode on the CPU, as its design has it.

``--embeddings`` serves ``POST /v1/embeddings`` through LitServe's ``OpenAIEmbeddingSpec`` instead:
``input`` is one image data URL, the backend is asked for its pooled features (``WorkItem.task ==
"embed"``) once per batch, and the spec answers floats (it ignores ``encoding_format``).

Defaults are LitServe's best on the 2-core bench machine: 2 workers of 1 torch thread each (the
decode of one overlaps the model of the other), batches of up to 4 gathered for 5 ms.
"""

from __future__ import annotations

import argparse
import base64
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the bench venv does not install the project: use the checkout
    sys.path.insert(0, str(REPO))

import litserve as ls  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

MAX_PIXELS = 8192 * 8192


def _image_url(request: Any) -> str:
    """The single image_url of a ChatCompletionRequest (LitServe's pydantic model)."""
    urls = [
        part.image_url.url
        for message in request.messages
        if isinstance(message.content, list)
        for part in message.content
        if getattr(part, "type", None) == "image_url"
    ]
    if len(urls) != 1:
        raise ValueError("send exactly one image_url part")
    return urls[0]


def make_backend(mode: str, device: str, threads: int) -> Any:
    """The project's backend for ``mode``: an explicit table, as in bench/naive_server.py."""
    if mode == "efficientnet":
        from shmgate.worker.backends.efficientnet import EfficientNetBackend

        return EfficientNetBackend(torch.device(device), threads=threads)
    from shmgate.worker.backends.checksum import ChecksumBackend

    return ChecksumBackend(torch.device(device))


def _tensors(preprocessor: Any, url: str) -> dict[str, list[torch.Tensor]]:
    """Decode and preprocess one data URL's image into host tensors, as shmgate's frontends do."""
    header, _, payload = url.partition(",")
    if not header.startswith("data:"):
        raise ValueError("the image must be a base64 data URL")
    tensors: dict[str, list[torch.Tensor]] = {}

    def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        array = np.empty(shape, dtype=dtype)
        tensors.setdefault(name, []).append(torch.from_numpy(array))
        return array

    preprocessor.preprocess_image(base64.b64decode(payload), allocate, max_pixels=MAX_PIXELS)
    return tensors


class EfficientNetAPI(ls.LitAPI):
    """decode_request runs per request in the worker; predict runs the model once per batch."""

    def __init__(self, *, mode: str, threads: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mode = mode
        self.threads = threads

    def setup(self, device: str) -> None:
        from shmgate.gateway.preprocess.vision import ChecksumPreprocessor, EfficientNetPreprocessor

        torch.set_num_threads(self.threads)
        self.preprocessor = ChecksumPreprocessor() if self.mode == "checksum" else EfficientNetPreprocessor()
        self.backend = make_backend(self.mode, device, self.threads)
        self.next_id = 0

    def decode_request(self, request: Any, **kwargs: Any) -> dict[str, list[torch.Tensor]]:
        return _tensors(self.preprocessor, _image_url(request))

    def batch(self, inputs: list[dict[str, list[torch.Tensor]]]) -> list[dict[str, list[torch.Tensor]]]:
        return inputs  # the backend stacks the items itself

    def predict(self, inputs: Any) -> Iterator[Any]:
        from shmgate.worker.backends.base import WorkItem

        batched = isinstance(inputs, list)
        items = inputs if batched else [inputs]
        work = []
        for tensors in items:
            self.next_id += 1
            work.append(WorkItem(request_id=self.next_id, tensors=tensors))
        texts = [""] * len(work)
        for event in self.backend.run(work):
            texts[event.index] += event.text
        yield texts if batched else texts[0]

    def unbatch(self, output: Any) -> Any:
        return output

    def encode_response(self, output_stream: Iterator[Any], **kwargs: Any) -> Iterator[Any]:
        for outputs in output_stream:
            if isinstance(outputs, list):
                yield [{"role": "assistant", "content": text} for text in outputs]
            else:
                yield {"role": "assistant", "content": outputs}


class EmbeddingAPI(ls.LitAPI):
    """/v1/embeddings: decode_request per request in the worker, one forward pass per batch in predict."""

    def __init__(self, *, threads: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.threads = threads

    def setup(self, device: str) -> None:
        from shmgate.gateway.preprocess.vision import EfficientNetPreprocessor

        torch.set_num_threads(self.threads)
        self.preprocessor = EfficientNetPreprocessor()
        self.backend = make_backend("efficientnet", device, self.threads)

    def decode_request(self, request: Any, **kwargs: Any) -> dict[str, list[torch.Tensor]]:
        url = request.input[0] if isinstance(request.input, list) else request.input
        return _tensors(self.preprocessor, url)

    def batch(self, inputs: list[dict[str, list[torch.Tensor]]]) -> list[dict[str, list[torch.Tensor]]]:
        return inputs

    def predict(self, inputs: Any) -> Any:
        from shmgate.worker.backends.base import WorkItem

        batched = isinstance(inputs, list)
        work = [WorkItem(i, tensors, task="embed") for i, tensors in enumerate(inputs if batched else [inputs])]
        vectors: list[list[float]] = [[] for _ in work]
        for event in self.backend.run(work):
            if event.vector is not None:
                vectors[event.index] = np.frombuffer(event.vector, dtype="<f4").tolist()
        return vectors if batched else vectors[0]

    def unbatch(self, output: Any) -> Any:
        return output

    def encode_response(self, output: Any, **kwargs: Any) -> Any:
        return {"embeddings": [output]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    parser.add_argument(
        "--mode",
        choices=["checksum", "efficientnet"],
        default="efficientnet",
        help="checksum measures LitServe's serving overhead alone",
    )
    parser.add_argument("--workers", type=int, default=2, help="inference processes (workers_per_device)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--batch-timeout", type=float, default=0.005, help="seconds to gather a batch")
    parser.add_argument("--api-servers", type=int, default=1, help="HTTP server processes")
    parser.add_argument(
        "--accelerator",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: one GPU, --workers processes on it (LitServe passes each its cuda:N)",
    )
    parser.add_argument("--embeddings", action="store_true", help="serve /v1/embeddings (efficientnet features)")
    args = parser.parse_args(argv)
    api: ls.LitAPI
    if args.embeddings:
        api = EmbeddingAPI(
            threads=args.threads,
            max_batch_size=args.max_batch_size,
            batch_timeout=args.batch_timeout,
            spec=ls.OpenAIEmbeddingSpec(),
        )
    else:
        api = EfficientNetAPI(
            mode=args.mode,
            threads=args.threads,
            max_batch_size=args.max_batch_size,
            batch_timeout=args.batch_timeout,
            spec=ls.OpenAISpec(),
        )
    server = ls.LitServer(api, accelerator=args.accelerator, devices=1, workers_per_device=args.workers, timeout=60)
    server.run(
        host=args.host,
        port=args.port,
        num_api_servers=args.api_servers,
        log_level="warning",
        generate_client_file=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
