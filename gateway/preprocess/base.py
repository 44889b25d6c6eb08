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

import abc
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shmgate.shared.errors import InvalidRequest

if TYPE_CHECKING:
    from shmgate.gateway.tool_prompt import ToolPrompt
    from shmgate.gateway.video import VideoLimits

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


class Preprocessor(abc.ABC):
    """Frontend half of a model. Implementations: vision.py (fixed-size classifiers), embed_hf.py, hf.py.

    Every capability the gateway reads is declared here with its default, so a route asks the
    preprocessor (``preprocessor.serves_chat``) instead of probing for an attribute, and a new model
    states what it differs in and inherits the rest. The three methods every model must have are
    abstract: a subclass that lacks one cannot be instantiated, and mypy says so where it is built.
    """

    model: str  # the public model id served under /v1/models
    max_images: int  # per request; more is a 400
    # True when build_prompt is microseconds of plain Python (no tokenizer): the frontend then calls it
    # on the event loop instead of paying a thread hop per request.
    prompt_is_cheap: bool = False
    # /v1/chat/completions answers for this model (an embedding-only model says False: a 400 there).
    serves_chat: bool = True
    # /v1/embeddings: the vector's length, None for a model that produces no embeddings.
    embedding_dim: int | None = None
    embeds_text: bool = False  # /v1/embeddings accepts text inputs (else images only)
    # The model's context bound in tokens (prompt + answer); /v1/models reports it as max_model_len.
    max_prompt_tokens: int | None = None
    # True when the worker samples tokens, so token-level request fields (logit_bias, logprobs, n,
    # penalties) mean something; their token ids must then be below ``vocab_size``.
    samples_tokens: bool = False
    vocab_size: int | None = None
    # True when /tokenize and /detokenize can answer: the model has a tokenizer and a chat prompt.
    tokenizes: bool = False
    # True when the answer is a pure function of the request (the classifier's labels): the result
    # cache (gateway/result_cache.py) may keep it.
    deterministic_answers: bool = False

    def tool_prompt(self) -> ToolPrompt | None:
        """How this model's prompts carry tools and its answers calls (gateway/tool_prompt.py); None (the
        default): it calls no tools, and a request that offers some is a 400 naming the model."""
        return None

    @abc.abstractmethod
    def cache_params(self) -> bytes:
        """Bytes that identify the preprocessing configuration; part of the content cache key."""

    @abc.abstractmethod
    def preprocess_image(
        self, data: bytes, allocate: AllocateFn, *, max_pixels: int, options: dict[str, Any] | None = None
    ) -> None:
        """Decode ``data`` and write its tensors into buffers obtained from ``allocate``.

        ``options`` are this image's processor arguments, as ``image_options`` made them (None or
        empty: the configured processing). Raises UndecodableImage or ImageTooLarge (shared.errors)
        for bad input. Runs in a thread; must not touch the event loop.
        """

    def plan_image(self, width: int, height: int, options: dict[str, Any] | None) -> int:
        """Before any decode, from the header's ``width`` x ``height`` and this image's ``options``: the
        bytes the processor's own work will take beyond the decode (counted in the decode budget, 0 when
        negligible). Raises InvalidRequest when the image alone cannot fit the model's context."""
        return 0

    @abc.abstractmethod
    def build_prompt(self, messages: Sequence[dict[str, Any]], images: Sequence[ImageTensorSpec]) -> PromptInputs:
        """Turn the conversation into the inline payload and text for the worker.

        ``messages`` are OpenAI chat messages in Hugging Face chat-template form: each
        ``content`` is a list of ``{"type": "text", "text": ...}`` and ``{"type": "image"}``
        parts, the images in the same order as ``images``. Raises InvalidRequest.
        """

    def image_options(self, request_kwargs: dict[str, Any] | None, detail: str | None) -> dict[str, Any]:
        """One image's processor arguments from its ``image_url.detail`` and the request's
        ``mm_processor_kwargs``. By default a model has one fixed input resolution: ``detail`` has
        nothing to choose between (accepted, documented) and ``mm_processor_kwargs`` is refused."""
        if request_kwargs:
            raise InvalidRequest(f"{self.model} takes no mm_processor_kwargs", param="mm_processor_kwargs")
        return {}

    def video_options(self) -> dict[str, Any]:
        """A ``video_url`` part's processing options (part of its content-cache key); a model that takes
        no video refuses it (gateway/video.py, gateway/preprocess/qwen_video.py)."""
        raise InvalidRequest(f"{self.model} does not take video input", param="messages")

    def preprocess_video(self, data: bytes, allocate: AllocateFn, reserve: Any, limits: VideoLimits) -> None:
        """Probe, sample and decode a video, writing its tensors through ``allocate`` (only a model whose
        ``video_options`` accepts video is asked); ``reserve(nbytes)`` holds decode memory; ``limits``:
        what one video may hold (the frontend's, gateway/video.py)."""
        raise InvalidRequest(f"{self.model} does not take video input", param="messages")

    def embedding_image_options(self) -> dict[str, Any]:
        """The processor arguments of an image sent to ``/v1/embeddings`` (none by default).

        Why apart from ``image_options``: a vector is compared with vectors made elsewhere, so a model
        may preprocess it closer to its reference than a label needs (gateway/preprocess/vision.py).
        The arguments are part of the image's content-cache key, so the two never share tensors.
        """
        return {}

    def prompt_token_ids(self, messages: Sequence[dict[str, Any]], images: Sequence[ImageTensorSpec]) -> list[int]:
        """The prompt's token ids exactly as the model reads them: what ``POST /tokenize`` answers.
        Only a model with ``tokenizes`` has them."""
        raise InvalidRequest(f"{self.model} has no tokenizer to count with", param="model")

    def text_token_ids(self, text: str) -> list[int]:
        """Plain text's token ids, special tokens added as the tokenizer adds them: ``POST /tokenize``
        with a ``prompt``. Only a model with ``tokenizes`` has them."""
        raise InvalidRequest(f"{self.model} has no tokenizer to count with", param="model")

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids``: what ``POST /detokenize`` answers. Only a model with ``tokenizes`` has it."""
        raise InvalidRequest(f"{self.model} has no tokenizer to count with", param="model")


def options_key(options: dict[str, Any]) -> bytes:
    """What an image's processor options add to its content-cache key (empty for none)."""
    return json.dumps(options, sort_keys=True, default=str).encode() if options else b""
