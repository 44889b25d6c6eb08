"""The preprocessing interface: what a frontend runs for a model, without the model.

The frontend turns each image of a request into named tensors written straight
into the arena (invariant 1: one decode per unique image, one copy into shared
memory), and the whole conversation into a small inline payload (token ids) and
text. The worker's backend receives exactly these tensors by name.

``preprocess_image`` is called in a worker thread of the frontend (never on the
event loop) and asks for its output buffers through ``allocate`` as soon as it
knows their shapes: a fixed-size model writes its pixels into the arena buffer
directly; a processor that makes its own arrays copies each once into the arena.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["AllocateFn", "ImageTensorSpec", "Preprocessor", "PromptInputs", "options_key"]

# allocate(name, dtype, shape) -> a writable numpy array of that dtype and shape that lives in the
# arena. Raises shared.errors.ArenaFull / Overloaded when there is no room.
AllocateFn = Callable[[str, str, tuple[int, ...]], np.ndarray]

# What the frontend knows about one image's tensors without reading them: name -> (dtype, shape).
ImageTensorSpec = dict[str, tuple[str, tuple[int, ...]]]


class PromptInputs:
    """What the worker needs besides the image tensors."""

    __slots__ = ("inline", "text", "prompt_tokens")

    def __init__(self, inline: bytes = b"", text: str = "", prompt_tokens: int = 0) -> None:
        self.inline = inline  # e.g. int32 token ids; rides in the descriptor when <= INLINE_MAX_BYTES
        self.text = text
        self.prompt_tokens = prompt_tokens


class Preprocessor(Protocol):
    """Frontend half of a model. Implementations: vision.py (fixed-size classifiers), hf.py."""

    model: str  # the public model id served under /v1/models
    max_images: int  # per request; more is a 400
    # True when build_prompt is microseconds of plain Python (no tokenizer): the frontend then calls it
    # on the event loop instead of paying a thread hop per request.
    prompt_is_cheap: bool

    def cache_params(self) -> bytes:
        """Bytes that identify the preprocessing configuration; part of the content cache key."""
        ...

    def preprocess_image(self, data: bytes, allocate: AllocateFn, *, max_pixels: int) -> None:
        """Decode ``data`` and write its tensors into buffers obtained from ``allocate``.

        Raises UndecodableImage or ImageTooLarge (shared.errors) for bad input.
        Runs in a thread; must not touch the event loop.
        """
        ...

    def build_prompt(self, messages: Sequence[dict[str, Any]], images: Sequence[ImageTensorSpec]) -> PromptInputs:
        """Turn the conversation into the inline payload and text for the worker.

        ``messages`` are OpenAI chat messages in Hugging Face chat-template form: each
        ``content`` is a list of ``{"type": "text", "text": ...}`` and ``{"type": "image"}``
        parts, the images in the same order as ``images``. Raises InvalidRequest.
        """
        ...


def options_key(options: dict[str, Any]) -> bytes:
    """What an image's processor options add to its content-cache key (empty for none)."""
    return json.dumps(options, sort_keys=True, default=str).encode() if options else b""
