"""Images whose tensors differ in size, placed together in a 1 MiB partition after a scattered fill.

A real ``shmgate serve --model checksum:hf:<tiny Qwen2-VL> --arena-size 1MiB --frontends 1``: its
``pixel_values`` take the size of the image (float32 patches), so evicting the least recently used
cached image can leave the free space in holes too small for the next image of the same request.
The worker reports the digest of every tensor it read; they must equal transformers' own processor's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("transformers")

from tests.conftest import _serve
from tests.hf_fixture import reference_processor
from tests.serving import Server
from tests.test_hf_transport import Case, noise_image


@pytest.fixture(scope="module")
def small_arena_server(tiny_qwen2_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(
        f"checksum:hf:{tiny_qwen2_vl_dir}",
        tmp_path_factory,
        "--frontends",
        "1",
        "--workers",
        "1",
        "--arena-size",
        "1MiB",
    )


def test_two_images_that_fit_together_are_placed_after_a_scattered_fill(
    small_arena_server: Server, tiny_qwen2_vl_dir: Path
) -> None:
    # 112x112: 294 KiB of pixel_values, 168x168: 459 KiB, 112x56: 147 KiB fill the partition in that
    # order; the first and last are used again, so the 168x168 one is the least recently used. Two new
    # 168x168 images (918 KiB) fit the partition; the first goes into the evicted image's hole, and
    # the second finds 294 and 270 KiB holes, nothing else held: before, a 503 arena_full every time.
    url = small_arena_server.base_url + "/v1/chat/completions"
    fill = [noise_image(112, 112, 1), noise_image(168, 168, 2), noise_image(112, 56, 3)]
    with httpx.Client(timeout=60) as client:
        for image in [*fill, fill[0], fill[2]]:
            response = client.post(url, json=Case("Fill the cache.", (image, "image/png")).body())
            assert response.status_code == 200, response.text
        pair = Case(
            "Compare these two.", (noise_image(168, 168, 4), "image/png"), (noise_image(168, 168, 5), "image/png")
        )
        response = client.post(url, json=pair.body())
    assert response.status_code == 200, response.text
    want: dict[str, Any]
    want, _ = pair.expected(reference_processor(tiny_qwen2_vl_dir))
    assert json.loads(response.json()["choices"][0]["message"]["content"]) == want
