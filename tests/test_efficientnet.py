"""EfficientNet-Lite0 end to end on CPU: frontend preprocessing + worker backend vs labels.json.

The model is loaded once per module. Probabilities are compared with the reference that
tests/data/images/labels.json records (shorter side 256 bicubic, centre crop 224, [-1, 1]).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shmgate.gateway.preprocess.vision import ChecksumPreprocessor, EfficientNetPreprocessor, FixedSizePreprocessor
from shmgate.shared.errors import InvalidRequest, TooManyImages
from shmgate.worker.backends.base import BackendEvent, WorkItem
from shmgate.worker.backends.efficientnet import EfficientNetBackend, EfficientNetLite0, _groups, load_lite0_state_dict

IMAGES = Path(__file__).parent / "data" / "images"
LABELS: dict[str, dict[str, Any]] = json.loads((IMAGES / "labels.json").read_text())["images"]
PHOTOS = sorted(LABELS)
LINE = re.compile(r"^(?P<label>[^\n]+): (?P<prob>[01]\.\d{4})\n$")


@pytest.fixture(scope="module")
def backend() -> EfficientNetBackend:
    return EfficientNetBackend(torch.device("cpu"))


def preprocess(name: str, preprocessor: FixedSizePreprocessor | None = None) -> np.ndarray:
    """Run the frontend half with a numpy-backed ``allocate``; returns the pixels it wrote."""
    buffers: dict[str, np.ndarray] = {}

    def allocate(tensor: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        assert tensor not in buffers
        buffers[tensor] = np.empty(shape, dtype)
        return buffers[tensor]

    (preprocessor or EfficientNetPreprocessor()).preprocess_image(
        (IMAGES / name).read_bytes(), allocate, max_pixels=40_000_000
    )
    assert list(buffers) == ["pixels"]
    return buffers["pixels"]


def answers(backend: EfficientNetBackend, items: list[WorkItem]) -> dict[int, list[BackendEvent]]:
    events: dict[int, list[BackendEvent]] = {i: [] for i in range(len(items))}
    for event in backend.run(items):
        events[event.index].append(event)
    return events


def parse_answer(events: list[BackendEvent]) -> list[tuple[str, float]]:
    *lines, final = events
    assert final.finish_reason == "stop" and final.text == ""
    assert final.completion_tokens == len(lines) and final.prompt_tokens == 0
    parsed = []
    for event in lines:
        assert event.finish_reason is None
        match = LINE.match(event.text)
        assert match, event.text
        parsed.append((match["label"], float(match["prob"])))
    return parsed


def worst_deviation(name: str, top: list[tuple[str, float]]) -> float:
    """Largest |ours - reference| over the reference top 5 (a label we did not list counts as 0)."""
    ours = dict(top)
    return max(abs(ours.get(ref["label"], 0.0) - float(ref["prob"])) for ref in LABELS[name]["reference_top5"])


def test_published_weights_load_strictly_into_all_296_tensors() -> None:
    state = load_lite0_state_dict()
    assert len(state) == 296
    model = EfficientNetLite0()
    model.load_state_dict(state, strict=True)
    assert set(model.state_dict()) == set(state)


def test_preprocessing_writes_uint8_chw_224() -> None:
    pixels = preprocess("coffee_640.jpg")
    assert pixels.shape == (3, 224, 224) and pixels.dtype == np.uint8


def test_six_photos_get_the_reference_labels(backend: EfficientNetBackend) -> None:
    items = [WorkItem(i, {"pixels": [torch.from_numpy(preprocess(name))]}) for i, name in enumerate(PHOTOS)]
    events = answers(backend, items)
    for i, name in enumerate(PHOTOS):
        top = parse_answer(events[i])
        assert len(top) == 5
        assert top[0][0] in LABELS[name]["accept_top1"], (name, top)
        assert worst_deviation(name, top) <= 0.03, (name, top)


def test_full_decode_reproduces_the_reference_probabilities_closely(backend: EfficientNetBackend) -> None:
    full = EfficientNetPreprocessor(draft_margin=0)
    items = [WorkItem(i, {"pixels": [torch.from_numpy(preprocess(n, full))]}) for i, n in enumerate(PHOTOS)]
    events = answers(backend, items)
    for i, name in enumerate(PHOTOS):
        assert worst_deviation(name, parse_answer(events[i])) <= 1e-3, name


def test_batch_of_six_equals_six_batches_of_one(backend: EfficientNetBackend) -> None:
    pixels = [torch.from_numpy(preprocess(name)) for name in PHOTOS]
    batched_probs, batched_labels = backend.classify(pixels)
    for i, one in enumerate(pixels):
        probs, labels = backend.classify([one])
        assert labels[0] == batched_labels[i]
        np.testing.assert_allclose(probs[0], batched_probs[i], atol=1e-4)


def test_item_with_several_images_gets_one_block_per_image(backend: EfficientNetBackend) -> None:
    two = [torch.from_numpy(preprocess("coffee_640.jpg")), torch.from_numpy(preprocess("camera_640.jpg"))]
    events = answers(backend, [WorkItem(7, {"pixels": two})])[0]
    text = "".join(e.text for e in events)
    blocks = text.split("image 2:\n")
    assert blocks[0].startswith("image 1:\nespresso: ") and blocks[1].startswith("tripod: ")
    assert events[-1].completion_tokens == 10


def test_cancelled_item_finishes_without_output(backend: EfficientNetBackend) -> None:
    live = WorkItem(1, {"pixels": [torch.from_numpy(preprocess("coffee_640.jpg"))]})
    gone = WorkItem(2, {"pixels": [torch.from_numpy(preprocess("camera_640.jpg"))]}, cancelled=True)
    events = answers(backend, [gone, live])
    assert [(e.text, e.finish_reason) for e in events[0]] == [("", "stop")]
    assert parse_answer(events[1])[0][0] == "espresso"


@pytest.mark.parametrize(
    "tensors",
    [{}, {"pixels": [torch.zeros(3, 224, 224)]}, {"pixels": [torch.zeros(3, 256, 256, dtype=torch.uint8)]}],
)
def test_malformed_pixels_are_refused(backend: EfficientNetBackend, tensors: dict[str, list[torch.Tensor]]) -> None:
    with pytest.raises(InvalidRequest):
        list(backend.run([WorkItem(1, tensors)]))


# -- the frontend half's other duties --------------------------------------------------------


def test_prompt_carries_the_user_text_only() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be terse"},
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": "image"}]},
        {"role": "user", "content": "and now?"},
    ]
    spec = EfficientNetPreprocessor().tensor_spec()
    prompt = EfficientNetPreprocessor().build_prompt(messages, [spec])
    assert prompt.text == "what is this?\nand now?"
    assert prompt.inline == b"" and prompt.prompt_tokens == 0


def test_image_count_is_bounded() -> None:
    spec = EfficientNetPreprocessor().tensor_spec()
    no_messages: list[dict[str, Any]] = []
    with pytest.raises(TooManyImages):
        EfficientNetPreprocessor(max_images=2).build_prompt(no_messages, [spec] * 3)
    with pytest.raises(InvalidRequest):
        EfficientNetPreprocessor().build_prompt([{"role": "user", "content": "hi"}], [])
    assert ChecksumPreprocessor().build_prompt([{"role": "user", "content": "hi"}], []).text == "hi"


def test_cache_params_name_the_pipeline_not_the_model() -> None:
    """Two fixed-size models with one pipeline produce the same bytes: they share a decode on one node."""
    efficientnet, checksum = EfficientNetPreprocessor().cache_params(), ChecksumPreprocessor().cache_params()
    assert efficientnet == checksum
    assert b"efficientnet-lite0" not in efficientnet
    assert b"resize_shorter=256" in efficientnet and b"crop=224" in efficientnet
    assert EfficientNetPreprocessor(draft_margin=0).cache_params() != efficientnet
    assert EfficientNetPreprocessor(crop_to=192).cache_params() != efficientnet


@pytest.fixture
def passes_of_two(backend: EfficientNetBackend) -> Iterator[EfficientNetBackend]:
    """The backend with CPU forward passes of 2 images (the default with one torch thread)."""
    default = backend.pass_images
    backend.pass_images = 2
    yield backend
    backend.pass_images = default


def test_cpu_passes_are_two_images_per_torch_thread(backend: EfficientNetBackend) -> None:
    assert backend.pass_images == 2 * torch.get_num_threads()


def test_a_cpu_worker_batches_one_pass_unless_told_otherwise(backend: EfficientNetBackend) -> None:
    from shmgate.worker.backends.base import DEFAULT_BATCH_SIZE, batch_size_for
    from shmgate.worker.backends.checksum import ChecksumBackend

    assert batch_size_for(backend, 0) == backend.pass_images  # the default: a batch is one pass
    assert batch_size_for(backend, 8) == 8  # --max-batch-size wins
    assert batch_size_for(ChecksumBackend(), 0) == DEFAULT_BATCH_SIZE  # a backend with no preference


def test_forward_passes_of_two_give_the_answers_of_one_pass(passes_of_two: EfficientNetBackend) -> None:
    pixels = [torch.from_numpy(preprocess(name)) for name in PHOTOS]
    split_probs, split_labels = passes_of_two.classify(pixels)
    passes_of_two.pass_images = None
    whole_probs, whole_labels = passes_of_two.classify(pixels)
    assert split_labels == whole_labels
    np.testing.assert_allclose(split_probs, whole_probs, atol=1e-4)


def test_groups_keep_items_whole_within_the_pass_size() -> None:
    assert _groups([0, 1, 2, 3, 4], [1, 1, 1, 3, 1], 2) == [[0, 1], [2], [3], [4]]
    assert _groups([0, 2, 5], [1, 2, 1], None) == [[0, 2, 5]]
    assert _groups([], [], 2) == []


def test_a_group_answers_before_the_next_runs_and_a_late_cancel_is_honoured(
    passes_of_two: EfficientNetBackend,
) -> None:
    items = [WorkItem(i, {"pixels": [torch.from_numpy(preprocess(name))]}) for i, name in enumerate(PHOTOS)]
    finished: list[int] = []
    events: dict[int, list[BackendEvent]] = {i: [] for i in range(len(items))}
    for event in passes_of_two.run(items):
        events[event.index].append(event)
        if event.finish_reason is not None:
            finished.append(event.index)
            if event.index == 0:  # the first pass (items 0 and 1) is answered; the last has not run
                items[-1].cancelled = True
    assert finished[:2] == [0, 1] and sorted(finished) == list(range(len(items)))
    assert [(e.text, e.finish_reason) for e in events[len(items) - 1]] == [("", "stop")]
    for i, name in enumerate(PHOTOS[:-1]):
        assert parse_answer(events[i])[0][0] in LABELS[name]["accept_top1"], name
