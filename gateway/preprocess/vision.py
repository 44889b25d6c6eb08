"""Preprocessors for fixed-size image classifiers: one uint8 CHW tensor per image.

Pipeline (the one EfficientNet-Lite0's reference labels were made with, reproduced to
within 2e-4 in probability on tests/data/images): resize the shorter side to 256 with
Pillow's bicubic filter (longer side ``round(256 * long / short)``), centre-crop 224 x 224
(offset ``round((size - 224) / 2)``), keep uint8 RGB. Scaling to [-1, 1] is the worker's job,
on its device: uint8 is 4x smaller in the arena than float32.

How it is computed, and why:
- Only the kept region is resampled: ``Image.resize(box=...)`` with the crop mapped back to
  source coordinates gives the same pixels as resize-then-crop (Pillow still reads filter
  taps outside the box), but never builds the 256-wide intermediate. That also makes a
  10000 x 1 image cost the same as a square one instead of a 2.5-million-pixel-wide resize.
- JPEGs are drafted (libjpeg DCT scaling by 1/2, 1/4, 1/8) as long as the decoded shorter
  side stays >= 256 * ``draft_margin``, with the crop geometry kept exact through
  ``DecodedImage.extent``. The margins are the fastest that keep the stated bounds against an
  independent reference pipeline (bench/fidelity.py, tests/test_fidelity.py): a label
  (``DEFAULT_DRAFT_MARGIN``, 1.5) keeps top-1 agreement >= 99.5 %; an embedding
  (``EMBEDDING_DRAFT_MARGIN``, 2, through ``embedding_image_options``) keeps cosine >= 0.999,
  which 1.5 does not (0.998). Margin 1 (``FAST_DRAFT_MARGIN``) is ~25 % cheaper again but drifts
  (top-1 >= 99 %, cosine >= 0.99); ``--mm-processor-kwargs '{"jpeg_draft_margin": 1,
  "embedding_jpeg_draft_margin": 1}'`` chooses it, 0 decodes fully. Figures: docs/BENCHMARKS.md,
  "Fidelity of the fast paths".
- The arena buffer is requested only after decoding succeeded (a bad image never holds
  arena space) and is written once, one plane per channel from Pillow's own band split.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import PIL
from PIL import Image

from shmgate.gateway.imaging import DecodedImage, decode
from shmgate.gateway.preprocess.base import AllocateFn, ImageTensorSpec, Preprocessor, PromptInputs
from shmgate.shared.errors import InvalidRequest, TooManyImages

__all__ = [
    "ChecksumPreprocessor",
    "DEFAULT_DRAFT_MARGIN",
    "EMBEDDING_DRAFT_MARGIN",
    "EfficientNetPreprocessor",
    "FAST_DRAFT_MARGIN",
    "FixedSizePreprocessor",
    "centre_crop_box",
    "classifier_draft_margins",
]

PIXELS = "pixels"  # the TensorRef name the vision backends read
# JPEG draft margins (module docstring): the default keeps the fidelity bounds, the fast one is opt-in.
DEFAULT_DRAFT_MARGIN = 1.5
EMBEDDING_DRAFT_MARGIN = 2.0
FAST_DRAFT_MARGIN = 1.0
_DRAFT_MIN = "jpeg_draft_min"  # the internal image option an embedding's decode reads (never a client's)


class FixedSizePreprocessor(Preprocessor):
    """Frontend half of a classifier that takes ``(3, crop, crop)`` uint8 pixels.

    Subclasses set ``model`` (and ``min_images``); the pixel pipeline is shared so that two
    models configured alike produce byte-identical tensors (the checksum backend relies on it).
    """

    model: str = ""
    min_images: int = 1  # a classifier with nothing to classify is a client error
    prompt_is_cheap = True  # build_prompt only joins the user's text
    deterministic_answers = True  # a pure function of the pixels: --result-cache-mb may keep answers

    def __init__(
        self,
        max_images: int = 8,
        *,
        resize_to: int = 256,
        crop_to: int = 224,
        draft_margin: float = DEFAULT_DRAFT_MARGIN,
        embedding_draft_margin: float = EMBEDDING_DRAFT_MARGIN,
        reducing_gap: float | None = None,
    ) -> None:
        assert 0 < crop_to <= resize_to, "the crop must fit inside the resized image"
        assert max_images >= self.min_images, "max_images below min_images makes every request fail"
        self.max_images = max_images
        self.resize_to = resize_to
        self.crop_to = crop_to
        # Pillow's resize(reducing_gap=): an integer box reduction first, then bicubic over fewer pixels
        # (bench/fidelity.py measures it as a path); None resamples the source directly.
        self.reducing_gap = reducing_gap
        # A margin <= 0 disables JPEG drafting; see the module docstring for the trade-off.
        self._draft_min = round(resize_to * draft_margin) if draft_margin > 0 else 0
        self._embedding_draft_min = round(resize_to * embedding_draft_margin) if embedding_draft_margin > 0 else 0

    def embedding_image_options(self) -> dict[str, Any]:
        """An embedding's JPEG draft bound, when it is not a label's (module docstring)."""
        return {} if self._embedding_draft_min == self._draft_min else {_DRAFT_MIN: self._embedding_draft_min}

    def cache_params(self) -> bytes:
        """Everything that changes the output bytes: geometry, filter, draft, Pillow.

        Not the model: every fixed-size model runs this one pipeline, so two models configured alike
        (the classifier and the checksum model, or one model under two served names) produce the same
        bytes and share one decode of a repeated image in the node's content cache.
        """
        return (
            f"vision/2 resize_shorter={self.resize_to} resample=bicubic "
            f"crop={self.crop_to} layout=CHW dtype=uint8 jpeg_draft_min={self._draft_min} "
            + (f"reducing_gap={self.reducing_gap} " if self.reducing_gap is not None else "")
            + f"pillow={PIL.__version__}"
        ).encode()

    def tensor_spec(self) -> ImageTensorSpec:
        """The tensors ``preprocess_image`` writes for every image (known without decoding)."""
        return {PIXELS: ("uint8", (3, self.crop_to, self.crop_to))}

    def preprocess_image(
        self, data: bytes, allocate: AllocateFn, *, max_pixels: int, options: dict[str, Any] | None = None
    ) -> None:
        """Decode ``data`` and write ``pixels`` (uint8, (3, crop, crop)) through ``allocate``.

        ``options`` is empty for a label (one fixed input resolution: ``Preprocessor.image_options``)
        and ``embedding_image_options`` for an embedding.

        Raises UndecodableImage / ImageTooLarge for bad input (before allocating), and
        whatever ``allocate`` raises (ArenaFull, Overloaded).
        """
        draft_min = int((options or {}).get(_DRAFT_MIN, self._draft_min))
        draft_to = (draft_min, draft_min) if draft_min else None
        decoded = decode(data, max_pixels=max_pixels, draft_to=draft_to)
        crop = self.crop_to
        small = decoded.image.resize(
            (crop, crop),
            Image.Resampling.BICUBIC,
            box=centre_crop_box(decoded, self.resize_to, crop),
            reducing_gap=self.reducing_gap,
        )
        out = allocate(PIXELS, "uint8", (3, crop, crop))
        np.copyto(out, np.asarray(small).transpose(2, 0, 1))  # HWC -> CHW in one strided copy

    def build_prompt(self, messages: Sequence[dict[str, Any]], images: Sequence[ImageTensorSpec]) -> PromptInputs:
        """Nothing for the model (it ignores text); the user's text rides along in ``.text``.

        Raises TooManyImages / InvalidRequest for an image count outside
        [min_images, max_images] or a malformed message.
        """
        if len(images) > self.max_images:
            raise TooManyImages(
                f"{self.model} accepts at most {self.max_images} images per request; got {len(images)}."
            )
        if len(images) < self.min_images:
            raise InvalidRequest(f"{self.model} classifies images; the request contains none.", param="messages")
        return PromptInputs(text="\n".join(_user_texts(messages)))


class EfficientNetPreprocessor(FixedSizePreprocessor):
    """EfficientNet-Lite0: shorter side 256 bicubic, centre crop 224, uint8 CHW."""

    model = "efficientnet-lite0"
    embedding_dim = 1280  # /v1/embeddings: the pooled features before the classifier (images only)


class ChecksumPreprocessor(FixedSizePreprocessor):
    """The EfficientNet pipeline under another id, so gateway overhead is measured on the same tensors.

    A request without images is fine here: the checksum backend then lists no tensors.
    """

    model = "checksum"
    min_images = 0

    def build_prompt(self, messages: Sequence[dict[str, Any]], images: Sequence[ImageTensorSpec]) -> PromptInputs:
        """As the classifier's; with ``SHMGATE_CHECKSUM_FAULTS=1`` (tests only) the text
        ``checksum:block-loop <s>`` blocks the frontend's event loop for s seconds (build_prompt
        of this model runs on the loop): a wedged frontend whose heartbeat thread still beats.
        """
        prompt = super().build_prompt(messages, images)
        if os.environ.get("SHMGATE_CHECKSUM_FAULTS") == "1":
            match = re.fullmatch(r"checksum:block-loop (\d{1,3})", prompt.text.strip())
            if match:
                time.sleep(int(match.group(1)))
        return prompt


def centre_crop_box(decoded: DecodedImage, resize_to: int, crop: int) -> tuple[float, float, float, float]:
    """The source region (in ``decoded.image`` pixels) that becomes the centre crop.

    Geometry is computed on the file's full-resolution size, then mapped through
    ``decoded.extent``, so a drafted JPEG keeps the crop of a full decode.
    """
    width, height = decoded.original_size
    if width <= height:
        new_w, new_h = resize_to, max(resize_to, round(resize_to * height / width))
    else:
        new_w, new_h = max(resize_to, round(resize_to * width / height)), resize_to
    left = round((new_w - crop) / 2)
    top = round((new_h - crop) / 2)
    extent_w, extent_h = decoded.extent
    sx, sy = extent_w / new_w, extent_h / new_h
    img_w, img_h = decoded.image.size
    return (left * sx, top * sy, min((left + crop) * sx, img_w), min((top + crop) * sy, img_h))


def _user_texts(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The text parts of user messages, in order. Raises InvalidRequest on a malformed message."""
    texts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise InvalidRequest("Each message must be an object.", param="messages")
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
            continue
        if not isinstance(content, list):
            raise InvalidRequest("A message's content must be a string or a list of parts.", param="messages")
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise InvalidRequest("A text part must carry a string 'text'.", param="messages")
                texts.append(text)
    return texts


def classifier_draft_margins(processor_kwargs: dict[str, Any] | None) -> dict[str, float]:
    """The FixedSizePreprocessor draft margins ``--mm-processor-kwargs`` sets: ``jpeg_draft_margin`` (labels)
    and ``embedding_jpeg_draft_margin`` (embeddings), the only keys a classifier takes.

    Raises ValueError naming an unknown key or a value that is not a number from 0 to 8 (the serve
    fails to start, rather than silently ignoring an option the operator meant).
    """
    options = dict(processor_kwargs or {})
    margins = {
        "draft_margin": options.pop("jpeg_draft_margin", DEFAULT_DRAFT_MARGIN),
        "embedding_draft_margin": options.pop("embedding_jpeg_draft_margin", EMBEDDING_DRAFT_MARGIN),
    }
    if options:
        raise ValueError(
            "--mm-processor-kwargs: classifier models take only jpeg_draft_margin and "
            f"embedding_jpeg_draft_margin, not {', '.join(sorted(options))}"
        )
    for margin in margins.values():
        if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin <= 8:
            raise ValueError("--mm-processor-kwargs: a JPEG draft margin is a number from 0 (no draft) to 8")
    return {name: float(margin) for name, margin in margins.items()}
