"""The worker reads bit for bit what the Hugging Face processor produced, through the real arena.

``shmgate serve --model checksum:hf:<dir>`` runs the real frontend half of ``hf:<dir>``
(image processor, chat template, tokenizer: gateway/preprocess/hf.py) and, instead of the
model, the checksum backend, which answers with the dtype, shape and blake2b of every
tensor the worker copied out of the arena and of the token ids it received. Each test
runs transformers' own Qwen2-VL processor on the same images and conversation and
compares: a byte lost, reordered, truncated or mixed up between requests anywhere
between the processor and the worker changes a digest.

Images of different sizes give different ``pixel_values`` shapes (dynamic resolution);
the requests run concurrently, repeat one image (a cache hit, perhaps from the other
frontend's partition) and include a prompt too long to ride in the descriptor (its token
ids go through the arena as ``__inline__``).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")

import httpx
from PIL import Image

from shmgate.shared.wire import INLINE_MAX_BYTES
from tests.conftest import _serve
from tests.hf_fixture import reference_processor
from tests.serving import IMAGES, Server, data_url

MODEL = "checksum:tiny-qwen2-vl"
LONG_TEXT = " ".join(f"Describe the picture number {i} in one sentence." for i in range(60))


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_vl_dir: Path) -> Path:
    return tiny_qwen2_vl_dir


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(f"checksum:hf:{model_dir}", tmp_path_factory, "--workers", "2", "--max-batch-size", "4")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    return reference_processor(model_dir)


def noise_image(width: int, height: int, seed: int) -> bytes:
    """A PNG of random pixels: sizes the test photos do not have, e.g. very wide or tall."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def blake2b_16(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def digest(array: np.ndarray) -> dict[str, Any]:
    return {"dtype": array.dtype.name, "shape": list(array.shape), "blake2b": blake2b_16(array.tobytes())}


class Case:
    """One request: images (bytes, mime) and text, in that order in the user message."""

    def __init__(self, text: str, *images: tuple[bytes, str]) -> None:
        self.text = text
        self.images = images

    def body(self) -> dict[str, Any]:
        parts: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": data_url(data, mime)}} for data, mime in self.images
        ]
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": self.text}]}],
        }

    def expected(self, reference: Any) -> tuple[dict[str, Any], list[int]]:
        """What the worker must report, computed with transformers' processor; and the token ids."""
        pictures = [Image.open(io.BytesIO(data)).convert("RGB") for data, _ in self.images]
        tensors = []
        for index, picture in enumerate(pictures):
            out = reference.image_processor(images=[picture], return_tensors="np")
            for name in ("image_grid_thw", "pixel_values"):
                tensors.append({"name": name, "index": index, **digest(out[name])})
        tensors.sort(key=lambda t: (t["name"], t["index"]))
        conversation = [
            {"role": "user", "content": [*({"type": "image"} for _ in pictures), {"type": "text", "text": self.text}]}
        ]
        text = reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        ids = reference(text=[text], images=pictures or None, return_tensors="np")["input_ids"][0].astype(np.int32)
        inline = {"nbytes": ids.nbytes, "blake2b": blake2b_16(ids.tobytes())}
        return {"tensors": tensors, "inline": inline}, ids.tolist()


def cases() -> list[Case]:
    def photo(name: str) -> tuple[bytes, str]:
        return (IMAGES / name).read_bytes(), "image/jpeg"

    def png(w: int, h: int, seed: int) -> tuple[bytes, str]:
        return noise_image(w, h, seed), "image/png"

    return [
        Case("What animal is this?", photo("chelsea_1024.jpg")),
        Case("What object?", photo("camera_640.jpg")),
        Case("A tall one.", png(90, 700, 1)),
        Case("A wide one.", png(900, 120, 2)),
        Case("Compare these two.", photo("coffee_640.jpg"), png(56, 56, 3)),
        Case(LONG_TEXT, png(200, 60, 4)),
        Case("Again, what animal?", photo("chelsea_1024.jpg")),  # a cache hit
        Case("No picture at all."),
    ]


async def post_all(server: Server, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for body in bodies))


def test_worker_reads_exactly_what_the_processor_produced(server: Server, reference: Any) -> None:
    todo = cases()
    expected = [case.expected(reference) for case in todo]
    shapes = {tuple(t["shape"]) for want, _ in expected for t in want["tensors"] if t["name"] == "pixel_values"}
    assert len(shapes) >= 5, f"the images should give different pixel_values shapes, got {shapes}"
    # (tall and wide noise have the same number of patches, but transposed grids)
    assert max(len(ids) for _, ids in expected) * 4 > INLINE_MAX_BYTES, "one prompt must go through the arena"

    responses = asyncio.run(post_all(server, [case.body() for case in todo] * 2))  # each twice, all at once
    for i, response in enumerate(responses):
        assert response.status_code == 200, response.text
        reply = response.json()
        want, _ = expected[i % len(todo)]
        assert json.loads(reply["choices"][0]["message"]["content"]) == want, f"request {i}"
        assert reply["usage"]["completion_tokens"] == len(want["tensors"])


def test_the_served_model_is_named_after_the_directory(server: Server) -> None:
    models = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    # the plain hf id is not served by this instance: the checksum witness never poses as the model
    body = Case("Hi").body() | {"model": "tiny-qwen2-vl"}
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
