"""``max_tokens`` on the classifier: one label line is one completion token, and a cut answer says "length".

What an OpenAI client expects of any model: ``usage.completion_tokens`` never exceeds
``max_tokens``, agrees with the text it got, and ``finish_reason`` is ``"length"`` exactly when
the answer was cut short.
"""

from __future__ import annotations

import pytest
import torch

from shmgate.shared.wire import SamplingParams
from shmgate.worker.backends.base import WorkItem
from shmgate.worker.backends.efficientnet import EfficientNetBackend
from tests.test_efficientnet import answers, backend, preprocess

__all__ = ["backend"]  # the module-scoped fixture, shared with tests/test_efficientnet.py


def _item(names: list[str], max_tokens: int | None) -> WorkItem:
    return WorkItem(
        1, {"pixels": [torch.from_numpy(preprocess(name)) for name in names]}, SamplingParams(max_tokens=max_tokens)
    )


def _labels(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("image ")]


@pytest.mark.parametrize(
    ("max_tokens", "lines", "finish"),
    [
        (1, 1, "length"),
        (3, 3, "length"),
        (4, 4, "length"),
        (5, 5, "stop"),
        (6, 5, "stop"),
        (None, 5, "stop"),
    ],
)
def test_max_tokens_bounds_the_label_lines_of_one_image(
    backend: EfficientNetBackend, max_tokens: int | None, lines: int, finish: str
) -> None:
    events = answers(backend, [_item(["coffee_640.jpg"], max_tokens)])[0]
    text = "".join(e.text for e in events)
    assert len(_labels(text)) == lines and text.startswith("espresso: ")
    assert (events[-1].completion_tokens, events[-1].finish_reason) == (lines, finish)


def test_max_tokens_cuts_a_several_image_answer_in_its_first_block(backend: EfficientNetBackend) -> None:
    events = answers(backend, [_item(["coffee_640.jpg", "camera_640.jpg"], 2)])[0]
    text = "".join(e.text for e in events)
    assert text.startswith("image 1:\nespresso: ") and "image 2:" not in text
    assert (len(_labels(text)), events[-1].completion_tokens, events[-1].finish_reason) == (2, 2, "length")
    whole = answers(backend, [_item(["coffee_640.jpg", "camera_640.jpg"], 10)])[0]
    assert (whole[-1].completion_tokens, whole[-1].finish_reason) == (10, "stop")
