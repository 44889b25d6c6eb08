"""The classifier preprocessing keeps its stated fidelity bounds against an independent reference.

The reference and the measurement are bench/fidelity.py's (full decode, EXIF transpose, RGB,
resize, centre crop, [-1, 1]; EfficientNet-Lite0's top-1 and pooled features). The set here is the
photos, every generated edge case and 6 seeded crops: deterministic, so a bound that held once
holds again, and a change to the default path that drifts fails here, not in a user's index.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.fidelity import Lite0, fidelity_set, gateway_pixels, measure
from shmgate.gateway.preprocess import get_preprocessor
from shmgate.gateway.preprocess.vision import DEFAULT_DRAFT_MARGIN, EMBEDDING_DRAFT_MARGIN, FAST_DRAFT_MARGIN
from tests.serving import image_request, start_server, stop_and_check

PHOTO = Path(__file__).parent / "data" / "images" / "camera_1024.jpg"  # 1024 x 1024: drafted at margin 1.5

# The bounds docs/BENCHMARKS.md states ("Fidelity of the fast paths"), measured on 428 images.
LABEL_MIN_TOP1 = 0.995  # the label path's default
EMBEDDING_MIN_COSINE = 0.999  # the embedding path's default
FAST_MIN_COSINE = 0.99
FAST_MAX_DISAGREEING = 1  # 99.1 % agreement over 428 images; here the near-tie cat photo flips
FULL_DECODE_MAX_PIXEL_DIFF = 8  # the crop-box resize against resize-then-crop: rounding only (7 measured)


@pytest.fixture(scope="module")
def rows() -> dict[float, dict[str, Any]]:
    margins = (0.0, DEFAULT_DRAFT_MARGIN, EMBEDDING_DRAFT_MARGIN, FAST_DRAFT_MARGIN)
    measured = measure(fidelity_set(6), margins, Lite0())
    return {float(r["margin"]): r for r in measured if r["margin"] is not None}


def test_the_default_paths_keep_labels_and_embeddings(rows: dict[float, dict[str, Any]]) -> None:
    assert rows[DEFAULT_DRAFT_MARGIN]["top1_agreement"] >= LABEL_MIN_TOP1, rows[DEFAULT_DRAFT_MARGIN]
    embedding = rows[EMBEDDING_DRAFT_MARGIN]
    assert embedding["min_cosine"] >= EMBEDDING_MIN_COSINE, embedding
    assert embedding["top1_agreement"] >= LABEL_MIN_TOP1, embedding


def test_the_fast_path_keeps_its_stated_bound(rows: dict[float, dict[str, Any]]) -> None:
    fast = rows[FAST_DRAFT_MARGIN]
    assert fast["min_cosine"] >= FAST_MIN_COSINE, fast
    assert len(fast["top1_disagreeing"]) <= FAST_MAX_DISAGREEING, fast


def test_a_full_decode_matches_the_reference_on_every_edge_case(rows: dict[float, dict[str, Any]]) -> None:
    """EXIF orientations, CMYK, 16-bit, alpha, palette, WebP, tiny and odd sizes: the same picture."""
    full = rows[0.0]
    assert full["pixel_max_abs_diff"] <= FULL_DECODE_MAX_PIXEL_DIFF, full
    assert full["top1_agreement"] == 1.0 and full["min_cosine"] >= 0.9995, full


def test_the_draft_margins_are_processor_options() -> None:
    default = get_preprocessor("efficientnet-lite0")
    assert b"jpeg_draft_min=384 " in default.cache_params()
    assert default.embedding_image_options() == {"jpeg_draft_min": 512}  # part of the cache key: apart
    fast = get_preprocessor(
        "efficientnet-lite0",
        processor_kwargs={"jpeg_draft_margin": FAST_DRAFT_MARGIN, "embedding_jpeg_draft_margin": FAST_DRAFT_MARGIN},
    )
    assert b"jpeg_draft_min=256 " in fast.cache_params()  # a different cache key: never each other's tensors
    assert fast.embedding_image_options() == {}  # the same decode for both: the same tensors
    assert (
        b"jpeg_draft_min=0 " in get_preprocessor("checksum", processor_kwargs={"jpeg_draft_margin": 0}).cache_params()
    )
    for bad in (
        {"jpeg_draft_margin": -1},
        {"jpeg_draft_margin": True},
        {"embedding_jpeg_draft_margin": "1"},
        {"max_pixels": 100},
    ):
        with pytest.raises(ValueError, match="--mm-processor-kwargs"):
            get_preprocessor("efficientnet-lite0", processor_kwargs=bad)


def _digest(margin: float) -> str:
    pixels = gateway_pixels(PHOTO.read_bytes(), margin).transpose(2, 0, 1)  # the arena's CHW bytes
    return hashlib.blake2b(pixels.tobytes(), digest_size=16).hexdigest()


def test_a_served_checksum_model_decodes_with_the_margin_it_was_given(tmp_path: Path) -> None:
    """``--mm-processor-kwargs`` reaches the frontends: the worker digests the fast path's pixels."""
    assert _digest(FAST_DRAFT_MARGIN) != _digest(DEFAULT_DRAFT_MARGIN)  # the photo tells the two apart
    server = start_server(
        "checksum",
        tmp_path,
        "--workers",
        "1",
        "--mm-processor-kwargs",
        json.dumps({"jpeg_draft_margin": FAST_DRAFT_MARGIN}),
    )
    try:
        reply = httpx.post(
            server.base_url + "/v1/chat/completions", json=image_request("checksum", PHOTO.read_bytes()), timeout=30
        )
        assert reply.status_code == 200, reply.text
        assert _digest(FAST_DRAFT_MARGIN) in reply.json()["choices"][0]["message"]["content"]
    finally:
        stop_and_check(server)
