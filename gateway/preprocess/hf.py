"""Frontend half of a Hugging Face vision-language model served as ``hf:<directory>``.

What runs here, and what never does:
- The image processor, the tokenizer and the chat template run here; the model never
  does. Only ``preprocessor_config.json``, the tokenizer files, the chat template and
  ``config.json`` are read (``AutoImageProcessor``, ``AutoTokenizer``, ``AutoConfig``);
  the weights are never opened, and nothing here imports torch itself (transformers
  imports it when it is installed; with it absent this module works all the same, which
  tests/test_hf.py checks by hiding torch).
- ``AutoProcessor`` is not used: in transformers 5.x ``Qwen2VLProcessor`` requires a
  video processor, which requires torchvision, even for images. The processor's parts
  are loaded directly and its one text step (expanding each image placeholder into one
  token per merged patch) is done here; tests check the ids equal the processor's.
- The image processor is pinned to the PIL/numpy backend, so the pixels a frontend
  writes do not depend on whether torchvision happens to be installed next to it.

What differs between families (the placeholder, each image's tokens, the processor outputs kept,
the prompt's special tokens) is the frontend half of the family's input style (shared/families/,
named by its record in shared/hf_families.py); this module runs it. What it still knows of one family:
the Qwen2-VL family's video (gateway/preprocess/qwen_video.py).

Invariants:
1. ``preprocess_image`` asks ``allocate`` for each output array once, after decoding and
   processing succeeded (a bad image never holds arena space), and copies it in once.
   For Qwen2-VL: ``pixel_values`` float32 ``[t*h*w, 3*2*14*14]``, ``image_grid_thw``
   int64 ``[1, 3]``, bit-identical to ``image_processor(images=[image])``.
2. ``build_prompt`` expands image placeholders with counts computed from the tensor
   *shapes* alone (``pixel_values`` rows = t*h*w, so tokens = rows // merge_size**2),
   because the cache hands the gateway shapes, not values. A fact the shapes would not fix is
   written as one (Idefics3's tile grid: shared/families/tiled.py ``TILE_GRID``; LLaVA-NeXT's token
   count, which depends on the original image size: any_resolution.py ``IMAGE_TOKENS``), computed
   at decode time, so cache hits carry it too.
3. Control tokens that a user writes in message text (``<|image_pad|>``, ``<|im_end|>``)
   are tokenized as plain text (transformers' ``sanitize_control_tokens``): a client
   cannot forge image slots or end a turn early.
4. Every count and token name a prompt is built from comes from the checkpoint, read the way
   transformers' processor class reads it: ``processor_config.json`` (``image_seq_length``,
   ``image_seq_len``, ``patch_size``, ...), the image processor's own settings, the tokenizer's
   named tokens (``tokenizer.image_token``, ``context_image_token``, ``boi_token``, ...) and its
   special tokens (a tokenizer that adds BOS gets it, unless the template wrote one, as the
   processor's ``apply_chat_template`` does). The model config is read only where the processor has
   no setting of its own, and a family's usual value is never assumed: a checkpoint whose model
   config still carries a stale copy (InternVL's ``image_seq_length``) is prompted as transformers
   prompts it.

Model id: the directory's base name (``hf:/models/Qwen2-VL-2B`` is served as
``Qwen2-VL-2B``), unless ``model_id`` is given; the worker's backend (worker/backends/
hf.py) derives its name by the same rule.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from shmgate.gateway.imaging import decode_image
from shmgate.gateway.preprocess.base import AllocateFn, ImageTensorSpec, Preprocessor, PromptInputs
from shmgate.gateway.preprocess.options import bounded_options
from shmgate.gateway.preprocess.qwen_video import (
    PIXEL_VALUES_VIDEOS,
    VIDEO_FAMILIES,
    VideoSettings,
    preprocess_video,
    video_tokens,
)
from shmgate.gateway.tool_prompt import ToolPrompt, tool_prompt_of
from shmgate.gateway.video import VIDEO_OPTION, VideoLimits
from shmgate.shared.errors import InvalidRequest, UndecodableImage
from shmgate.shared.families.base import PIXEL_VALUES, ImageSpec
from shmgate.shared.hf_families import chat_family  # each family's record, naming its style
from shmgate.shared.models import model_id_for  # the rules, said in shared/models.py

__all__ = ["PIXEL_VALUES", "HFPreprocessor", "model_id_for"]


def _processor_chat_template(path: str) -> str | None:
    """The processor's chat template file, which wins over the tokenizer's (as in ProcessorMixin)."""
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    legacy = os.path.join(path, "chat_template.json")
    if os.path.isfile(legacy):
        with open(legacy, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
        return template if isinstance(template, str) else None
    return None


# Processor arguments neither --mm-processor-kwargs nor a request may set: they change the tensor
# layout the model was built for (patch and merge sizes), or how the processor returns its output.
FIXED_PROCESSOR_KEYS = frozenset(
    {
        "patch_size",
        "temporal_patch_size",
        "merge_size",
        "return_tensors",
        "data_format",
        "input_data_format",
        "device",
        "disable_grouping",
        "image_seq_length",
        "return_row_col_info",
        "max_image_size",
        "image_grid_pinpoints",
        "do_pan_and_scan",  # Gemma 3's extra crops: the frontend carries the one view its prompt expects
    }
)


def _strict_validation() -> tuple[type[Exception], ...]:
    """transformers' strict dataclass check of processor arguments raises huggingface_hub's class."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: no strict validation
        return ()
    return (StrictDataclassError,)


# What a processor call raises for its options (not for the image): a 400 naming mm_processor_kwargs.
_OPTION_ERRORS: tuple[type[Exception], ...] = (TypeError, AttributeError, KeyError, *_strict_validation())


def _size_of(image_processor: Any) -> dict[str, Any]:
    """The processor's configured ``size`` as a plain dict of its set values (a dict or a SizeDict)."""
    size = getattr(image_processor, "size", None)
    if size is None:
        return {}
    items = size.items() if isinstance(size, dict) else vars(size).items()
    return {k: v for k, v in items if v is not None}


def processor_keys(image_processor: Any) -> frozenset[str]:
    """The arguments this image processor accepts (its ``valid_kwargs``), less FIXED_PROCESSOR_KEYS."""
    declared = getattr(getattr(image_processor, "valid_kwargs", None), "__annotations__", {})
    return frozenset(declared) - FIXED_PROCESSOR_KEYS


def _processor_settings(path: str) -> dict[str, Any]:
    """processor_config.json: the arguments ``from_pretrained`` gives the processor class ({} without one)."""
    config_file = os.path.join(path, "processor_config.json")
    if not os.path.isfile(config_file):
        return {}
    with open(config_file, encoding="utf-8") as f:
        settings = json.load(f)
    return settings if isinstance(settings, dict) else {}


def _special_wrapping(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text when asked for special tokens (BOS for
    Llama- and Gemma-style tokenizers, nothing for Qwen's): found by encoding a probe both ways."""
    plain = [int(i) for i in tokenizer.encode("a", add_special_tokens=False)]
    full = [int(i) for i in tokenizer.encode("a", add_special_tokens=True)]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []


class HFPreprocessor(Preprocessor):
    """Frontend half of ``hf:<directory>``: image processor, chat template and tokenizer.

    Thread-safety: ``preprocess_image`` keeps no state and may run in many threads at
    once. ``build_prompt`` takes a lock: to encode user-written control tokens as text,
    transformers flips a flag on the shared Rust tokenizer (``encode_special_tokens``)
    around each piece, and two prompts encoded at once could see each other's setting.
    """

    prompt_is_cheap = False  # the chat template and the tokenizer take milliseconds: keep them off the loop
    tokenizes = True  # /tokenize and /detokenize: prompt_token_ids, detokenize

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        max_images: int = 8,
        model_id: str | None = None,
        samples_tokens: bool = True,
        processor_kwargs: dict[str, Any] | None = None,
        tool_chat_template: str | None = None,
    ) -> None:
        """Load the processor parts from ``model_dir``.

        Raises ValueError when the directory holds a family shared/hf_families.py does not list, or
        an image processor its record does not name; ImportError without transformers.
        """
        try:
            from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise ImportError("hf:<directory> models need transformers: pip install 'shmgate[hf]'") from exc

        assert max_images >= 0, "max_images must be >= 0"
        path = os.fspath(model_dir)
        self.model = model_id or model_id_for(path)
        self.max_images = max_images
        family = chat_family(path)
        self.image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
        if processor_kwargs:  # --mm-processor-kwargs: the checkpoint's processor config, overridden
            unknown = set(processor_kwargs) - processor_keys(self.image_processor)
            if unknown:
                raise ValueError(
                    f"--mm-processor-kwargs: {sorted(unknown)} are not settable arguments of "
                    f"{type(self.image_processor).__name__}; known: {sorted(processor_keys(self.image_processor))}"
                )
            self.image_processor = AutoImageProcessor.from_pretrained(path, backend="pil", **processor_kwargs)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(path)
        kind = type(self.image_processor).__name__.removesuffix("Pil").removesuffix("Fast")
        if kind not in family.image_processors:
            raise ValueError(
                f"{path}: image processor {kind} is not supported for model_type {family.model_type!r}; "
                f"known: {', '.join(family.image_processors)}"
            )
        self._style = family.style  # its input style's frontend half (shared/families/)
        self.processor_settings = _processor_settings(path)
        self.image_token_id = self.named_token_id(self._style.token_attribute, self._style.image_token)
        # Video (gateway/preprocess/qwen_video.py): Qwen2-VL only; -1 matches no token id.
        self._video: VideoSettings | None = None
        self._video_token_id = -1
        if family.model_type in VIDEO_FAMILIES:
            self._video = VideoSettings.from_checkpoint(path, self.image_processor)
            self._video_token_id = self.named_token_id("video_token", "<|video_pad|>")
        # Some checkpoints keep the (multimodal) template beside the processor only.
        self.tokenizer.chat_template = _processor_chat_template(path) or self.tokenizer.chat_template
        # A style may carry the template of checkpoints that have none (PaliGemma's)
        self.tokenizer.chat_template = self.tokenizer.chat_template or self._style.chat_template()
        # What the processor's tokenizer call adds around a prompt (BOS, for many), unless the template
        # wrote BOS itself (``with_special_tokens``; a style that places its own, ``arrange``, ignores it).
        self._wrapping = _special_wrapping(self.tokenizer)
        self.added_ids = np.asarray(sorted(self.tokenizer.added_tokens_decoder), dtype=np.int32)
        if not self.tokenizer.chat_template:
            raise ValueError(f"{path}: no chat template (chat_template.jinja / .json or tokenizer_config.json)")
        self.model_config = AutoConfig.from_pretrained(path)
        text_config = self.model_config.get_text_config()
        self.max_prompt_tokens = getattr(text_config, "max_position_embeddings", None)
        # gateway/fields.py: token-level request fields are honoured only by a model that samples tokens
        # (not checksum:hf:), and their token ids must be below this.
        self.samples_tokens = samples_tokens
        self.vocab_size = int(text_config.vocab_size)
        self.tokenizer_lock = threading.Lock()
        self.tool_chat_template = tool_chat_template  # --tool-chat-template's text (gateway/tool_prompt.py)
        self.style_state: Any = self._style.prepare(self)  # what the style keeps for this checkpoint
        self._cache_params = self._describe_processing()

    def tool_prompt(self) -> ToolPrompt | None:
        """The tool format of this checkpoint's family and template (gateway/tool_prompt.py); none for
        ``checksum:hf:``, whose worker samples no tokens."""
        if not self.samples_tokens:
            return None
        return tool_prompt_of(self.tokenizer, str(self.model_config.model_type), self.tool_chat_template)

    def cache_params(self) -> bytes:
        """The image processor's full configuration, its class and the library versions.

        The model id is deliberately left out: two models whose image processors agree
        produce identical tensors, and may share cached ones.
        """
        return self._cache_params

    def _describe_processing(self) -> bytes:
        import PIL
        import transformers

        params = {
            "kind": "hf/1",
            "image_processor": type(self.image_processor).__name__,
            "config": self.image_processor.to_dict(),
            "transformers": transformers.__version__,
            "pillow": PIL.__version__,
        }
        return json.dumps(params, sort_keys=True, default=str).encode()

    def video_options(self) -> dict[str, Any]:
        """A video's processing options: its settings, in its content-cache key (gateway/video.py)."""
        if self._video is None:
            return super().video_options()
        return {VIDEO_OPTION: self._video.describe()}

    def preprocess_video(self, data: bytes, allocate: AllocateFn, reserve: Any, limits: VideoLimits) -> None:
        """Probe, sample, decode and patch a video (gateway/preprocess/qwen_video.py)."""
        if self._video is None:
            super().preprocess_video(data, allocate, reserve, limits)
            return
        preprocess_video(data, self._video, allocate, reserve, limits)

    def image_options(self, request_kwargs: dict[str, Any] | None, detail: str | None) -> dict[str, Any]:
        """One image's processor arguments: ``image_url.detail`` ("low": the architecture's low setting;
        "high", "auto" or none: the configured processor), then the request's ``mm_processor_kwargs``
        on top. Raises InvalidRequest naming ``mm_processor_kwargs`` for a key the processor does not
        accept (or one in FIXED_PROCESSOR_KEYS)."""
        options = self._style.low_detail(self.image_processor) if detail == "low" else {}
        if request_kwargs:
            unknown = set(request_kwargs) - processor_keys(self.image_processor)
            if unknown:
                raise InvalidRequest(
                    f"mm_processor_kwargs: {sorted(unknown)[:5]} are not settable for "
                    f"{type(self.image_processor).__name__}; accepted: {sorted(processor_keys(self.image_processor))}",
                    param="mm_processor_kwargs",
                )
            annotations = getattr(getattr(self.image_processor, "valid_kwargs", None), "__annotations__", {})
            options.update(bounded_options(request_kwargs, _size_of(self.image_processor), annotations))
        return options

    def plan_image(self, width: int, height: int, options: dict[str, Any] | None) -> int:
        """The bytes the processor's own work on this image will take, and a refusal when its tokens alone
        fill the context: the style's ``plan_image`` (the Qwen2-VL family's pixel budget), given the
        processor's ``size`` with this image's options on top. Raises InvalidRequest, UndecodableImage."""
        size = {**_size_of(self.image_processor), **((options or {}).get("size") or {})}
        return self._style.plan_image(self, width, height, size)

    def preprocess_image(
        self, data: bytes, allocate: AllocateFn, *, max_pixels: int, options: dict[str, Any] | None = None
    ) -> None:
        """Decode ``data``, run the image processor on it (with ``options``, ``image_options``'s), and
        copy each output into the arena.

        Raises UndecodableImage / ImageTooLarge for bad input (before allocating), InvalidRequest for
        options the processor refuses, and whatever ``allocate`` raises (ArenaFull, Overloaded).
        """
        image = decode_image(data, max_pixels=max_pixels)
        try:
            # channels_last: never let the processor guess the layout of a 3-pixel-tall image.
            out = self.image_processor(
                images=[image],
                return_tensors="np",
                input_data_format="channels_last",
                **dict(self._style.call_args),
                **(options or {}),
            )
        except _OPTION_ERRORS as exc:
            raise InvalidRequest(
                f"mm_processor_kwargs are not valid for this processor: {exc}", param="mm_processor_kwargs"
            ) from None
        except ValueError as exc:  # e.g. Qwen2-VL refuses aspect ratios above 200:1
            raise UndecodableImage(f"The image cannot be processed for this model: {exc}") from None
        arrays = {name: np.ascontiguousarray(value) for name, value in self._style.outputs(self, out).items()}
        for name, array in arrays.items():
            destination = allocate(name, array.dtype.name, tuple(array.shape))
            np.copyto(destination, array, casting="no")

    def build_prompt(
        self,
        messages: Sequence[dict[str, Any]],
        images: Sequence[ImageTensorSpec],
        **template_args: Any,
    ) -> PromptInputs:
        """Render the chat template, tokenize, and expand each image placeholder.

        Returns int32 token ids as ``inline`` and the rendered prompt (one placeholder per
        image) as ``text``. Raises InvalidRequest when the template rejects the
        conversation, when the image parts and ``images`` differ in number, or when the
        prompt leaves the model no room to answer. ``template_args``: the template's
        ``tools`` and an operator's ``chat_template`` (gateway/tool_prompt.py).
        """
        ids, expanded = self._prompt_ids(messages, images, **template_args)
        if self.max_prompt_tokens is not None and len(expanded) >= self.max_prompt_tokens:
            raise InvalidRequest(
                f"The prompt is {len(expanded)} tokens (images included); this model reads at most "
                f"{self.max_prompt_tokens - 1} before answering. Shorten the conversation or send smaller images."
            )
        with self.tokenizer_lock:
            text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        return PromptInputs(inline=expanded.tobytes(), text=text, prompt_tokens=len(expanded))

    def prompt_token_ids(self, messages: Sequence[dict[str, Any]], images: Sequence[ImageTensorSpec]) -> list[int]:
        """The prompt's token ids exactly as the model reads them (image tokens expanded), with no
        length check: what ``POST /tokenize`` answers (gateway/tokenize.py). Raises InvalidRequest."""
        return [int(i) for i in self._prompt_ids(messages, images)[1]]

    def text_token_ids(self, text: str) -> list[int]:
        """Plain text's token ids as the tokenizer gives them (special tokens added): ``POST /tokenize``
        with a ``prompt``."""
        with self.tokenizer_lock:
            return [int(i) for i in self.tokenizer.encode(text)]

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens included). Raises InvalidRequest for an id outside the vocabulary."""
        vocab = self.vocab_size or 0  # always set here (from the text config)
        if any(not 0 <= i < vocab for i in ids):
            raise InvalidRequest(f"a token id is outside the vocabulary (0..{vocab - 1})", param="tokens")
        with self.tokenizer_lock:
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def named_token_id(self, attribute: str, default: str) -> int:
        """The id of the tokenizer's named token ``attribute`` (``tokenizer.image_token``, ...), the name
        a processor class reads, else of ``default``."""
        name = getattr(self.tokenizer, attribute, None) or default
        return int(self.tokenizer.convert_tokens_to_ids(name))

    def video_tokens(self, spec: ImageSpec) -> int | None:
        """A video's tokens (gateway/preprocess/qwen_video.py); None when ``spec`` is not a video's."""
        if self._video and PIXEL_VALUES_VIDEOS in spec:
            return video_tokens(spec, self._video)
        return None

    def with_special_tokens(self, ids: np.ndarray) -> np.ndarray:
        """The template's ids as the processor's tokenizer call would give them: its special tokens
        around them (``_special_wrapping``), unless the template starts with BOS (the processor's
        ``apply_chat_template`` then adds none)."""
        prefix, suffix = self._wrapping
        if (not prefix and not suffix) or (len(ids) and ids[0] == self.tokenizer.bos_token_id):
            return ids
        return np.concatenate([np.asarray(prefix, np.int32), ids, np.asarray(suffix, np.int32)])

    def _prompt_ids(
        self, messages: Sequence[dict[str, Any]], images: Sequence[ImageTensorSpec], **template_args: Any
    ) -> tuple[np.ndarray, np.ndarray]:
        """(the template's ids with one placeholder per image, the ids with every placeholder expanded)."""
        import jinja2

        try:
            with self.tokenizer_lock:
                encoded = self.tokenizer.apply_chat_template(
                    list(messages),
                    tokenize=True,
                    add_generation_prompt=True,
                    sanitize_control_tokens=True,
                    return_dict=True,
                    **template_args,
                )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise InvalidRequest(f"The conversation does not fit this model's chat template: {exc}") from None
        ids = np.asarray(encoded["input_ids"], dtype=np.int32)
        ids = self._style.arrange(self, ids)
        is_video = ids == self._video_token_id  # video parts: gateway/preprocess/qwen_video.py
        slots = np.flatnonzero((ids == self.image_token_id) | is_video)
        if len(slots) != len(images):
            raise InvalidRequest(f"The messages hold {len(slots)} image parts but {len(images)} images were sent.")
        if [bool(v) for v in is_video[slots]] != [PIXEL_VALUES_VIDEOS in spec for spec in images]:
            raise InvalidRequest("The messages' image and video parts do not match the images and videos sent.")
        return ids, self._style.expand(self, ids, slots, images)
