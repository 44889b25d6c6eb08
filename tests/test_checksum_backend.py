"""The checksum backend reports exactly the bytes the frontend's preprocessing wrote."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shmgate.gateway.preprocess.vision import ChecksumPreprocessor, EfficientNetPreprocessor
from shmgate.worker.backends.base import BackendEvent, WorkItem
from shmgate.worker.backends.checksum import ChecksumBackend

IMAGES = Path(__file__).parent / "data" / "images"


def preprocess(preprocessor: ChecksumPreprocessor | EfficientNetPreprocessor, name: str) -> np.ndarray:
    out: dict[str, np.ndarray] = {}
    preprocessor.preprocess_image(
        (IMAGES / name).read_bytes(), lambda t, d, s: out.setdefault(t, np.empty(s, d)), max_pixels=40_000_000
    )
    return out["pixels"]


def run_one(item: WorkItem) -> list[BackendEvent]:
    events = list(ChecksumBackend().run([item]))
    assert all(e.index == 0 for e in events)
    return events


def answer(item: WorkItem) -> dict[str, Any]:
    events = run_one(item)
    assert events[-1].finish_reason == "stop"
    body: dict[str, Any] = json.loads("".join(e.text for e in events))
    return body


def blake2b_16(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def test_hash_equals_blake2b_of_the_preprocessed_array() -> None:
    pixels = preprocess(ChecksumPreprocessor(), "chelsea_1024.jpg")
    body = answer(WorkItem(5, {"pixels": [torch.from_numpy(pixels)]}))
    assert body == {
        "tensors": [
            {
                "name": "pixels",
                "index": 0,
                "dtype": "uint8",
                "shape": [3, 224, 224],
                "blake2b": blake2b_16(pixels.tobytes()),
            }
        ]
    }


def test_checksum_preprocessing_is_byte_identical_to_efficientnets() -> None:
    for name in ("chelsea_640.jpg", "camera_1024.jpg"):
        assert (
            preprocess(ChecksumPreprocessor(), name).tobytes() == preprocess(EfficientNetPreprocessor(), name).tobytes()
        )


def test_tensors_are_listed_by_name_then_in_order() -> None:
    a, b = torch.arange(6, dtype=torch.int32).reshape(2, 3), torch.ones(4, dtype=torch.float16)
    grid, half = torch.tensor([[1, 2, 2]], dtype=torch.int64), torch.full((2,), 1.5, dtype=torch.bfloat16)
    body = answer(WorkItem(1, {"pixel_values": [a, b], "image_grid_thw": [grid], "extra": [half]}))
    listed = [(t["name"], t["index"], t["dtype"], t["shape"]) for t in body["tensors"]]
    assert listed == [
        ("extra", 0, "bfloat16", [2]),
        ("image_grid_thw", 0, "int64", [1, 3]),
        ("pixel_values", 0, "int32", [2, 3]),
        ("pixel_values", 1, "float16", [4]),
    ]
    assert body["tensors"][2]["blake2b"] == blake2b_16(a.numpy().tobytes())
    assert body["tensors"][0]["blake2b"] == blake2b_16(half.view(torch.int16).numpy().tobytes())


def test_non_contiguous_tensor_is_hashed_in_c_order() -> None:
    base = torch.arange(12, dtype=torch.uint8).reshape(3, 4)
    body = answer(WorkItem(1, {"pixels": [base.t()]}))
    assert body["tensors"][0]["blake2b"] == blake2b_16(base.t().contiguous().numpy().tobytes())


def test_answer_streams_in_several_events_and_ends_once() -> None:
    events = run_one(WorkItem(1, {"pixels": [torch.zeros(3, 2, 2, dtype=torch.uint8)] * 2}))
    texts = [e.text for e in events if e.text]
    assert len(texts) >= 2 and texts[0] == '{"tensors":['
    finishes = [e for e in events if e.finish_reason is not None]
    assert len(finishes) == 1 and finishes[0] is events[-1]
    assert finishes[0].completion_tokens == 2 and finishes[0].prompt_tokens == 0


def test_item_without_tensors_lists_none() -> None:
    assert answer(WorkItem(1, {})) == {"tensors": []}


def test_every_item_of_a_batch_is_answered_cancelled_ones_without_text() -> None:
    items = [WorkItem(1, {}), WorkItem(2, {}, cancelled=True), WorkItem(3, {"x": [torch.zeros(1)]})]
    events = list(ChecksumBackend().run(items))
    finished = [e.index for e in events if e.finish_reason == "stop"]
    assert sorted(finished) == [0, 1, 2]
    assert all(e.text == "" for e in events if e.index == 1)


def test_a_trickle_adds_spaces_to_the_same_answer_and_trickles_of_a_batch_advance_together() -> None:
    tensors = {"pixels": [torch.arange(12, dtype=torch.uint8).reshape(3, 2, 2)]}
    plain = answer(WorkItem(1, tensors))
    batch = [WorkItem(2, tensors, text="checksum:trickle 5"), WorkItem(3, tensors, text="checksum:trickle 3")]
    events = list(ChecksumBackend().run(batch))
    for index, steps in ((0, 5), (1, 3)):
        text = "".join(e.text for e in events if e.index == index)
        assert json.loads(text) == plain and text.count(" ") == steps
    finishes = [e.index for e in events if e.finish_reason]
    assert finishes == [1, 0]  # the shorter trickle ends first: they ran side by side


def test_a_trickle_stops_as_soon_as_its_item_is_cancelled() -> None:
    item = WorkItem(4, {"pixels": [torch.zeros(3, dtype=torch.uint8)]}, text="checksum:trickle 100000")
    events = []
    for event in ChecksumBackend().run([item]):
        events.append(event)
        if event.text == " ":
            item.cancelled = True  # what the worker does when a Cancel arrives
    assert events[-1].finish_reason == "stop"
    assert sum(e.text == " " for e in events) == 1
