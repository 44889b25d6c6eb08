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

Invariants:
1. ``preprocess_image`` asks ``allocate`` for each output array once, after decoding and
   processing succeeded (a bad image never holds arena space), and copies it in once.
   For Qwen2-VL: ``pixel_values`` float32 ``[t*h*w, 3*2*14*14]``, ``image_grid_thw``
   int64 ``[1, 3]``, bit-identical to ``image_processor(images=[image])``.
2. ``build_prompt`` expands image placeholders with counts computed from the tensor
   *shapes* alone (``pixel_values`` rows = t*h*w, so tokens = rows // merge_size**2),
   because the cache hands the gateway shapes, not values. A fact the shapes would not fix is
   written as one (Idefics3's tile grid: ``TILE_GRID``; LLaVA-NeXT's token count, which depends on
   the original image size: ``IMAGE_TOKENS``), computed at decode time, so cache hits carry it too.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
from shmgate.gateway.video import VIDEO_OPTION
from shmgate.shared.errors import InvalidRequest, UndecodableImage
from shmgate.shared.hf_families import PromptStyle, chat_family  # each family's record
from shmgate.shared.models import model_id_for  # the rules, said in shared/models.py

__all__ = ["HFPreprocessor", "model_id_for"]

PIXEL_VALUES = "pixel_values"


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


@dataclass(frozen=True)
class _Architecture:
    """What differs between processor families: the placeholder token and its count per image, and
    the processor arguments ``image_url.detail: "low"`` stands for (``{}``: no lower setting)."""

    # The placeholder the chat template writes: the tokenizer's named token (``token_attribute``,
    # as the processor class reads it), else ``image_token``.
    image_token: str
    tokens_per_image: Callable[[HFPreprocessor, ImageTensorSpec], int]
    low_detail: Callable[[Any], dict[str, Any]] = lambda image_processor: {}
    # Families whose image expands into more than repeated placeholders (Idefics3's tile markers):
    # (preprocessor, spec) -> the image's token ids; tokens_per_image is then unused.
    expand: Callable[[HFPreprocessor, ImageTensorSpec], list[int]] | None = None
    # Extra image processor arguments, and what turns its output into the arrays the arena holds.
    call_args: tuple[tuple[str, Any], ...] = ()
    outputs: Callable[[HFPreprocessor, dict[str, Any]], dict[str, Any]] = lambda pre, out: dict(out)
    # Gemma 3: each placeholder becomes "\n\n" <boi> image_seq_length x <image> <eoi> "\n\n" as *text*, so
    # the newlines merge with the newlines around it; (boi, image, eoi) token names.
    wrapped: tuple[str, str, str] | None = None
    token_attribute: str = "image_token"


# image_url.detail "low" for the Qwen2-VL family: at most this many image tokens per image (OpenAI's
# low detail is one 512x512 view; 256 tokens of 28 x 28 px is 448 x 448 px, close to it).
LOW_DETAIL_TOKENS = 256


def _qwen_low_detail(image_processor: Any) -> dict[str, Any]:
    """A ``size`` bound of LOW_DETAIL_TOKENS merged patches, never above the configured one (``size`` is
    the processor's current form of ``max_pixels``/``min_pixels``, which transformers 5 deprecates)."""
    side = int(image_processor.patch_size) * int(image_processor.merge_size)
    size = image_processor.size or {}
    longest = min(int(size.get("longest_edge", 1 << 62)), LOW_DETAIL_TOKENS * side * side)
    return {"size": {"longest_edge": longest, "shortest_edge": min(int(size.get("shortest_edge", 0)), longest)}}


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


def _merged_patches(pre: HFPreprocessor, spec: ImageTensorSpec) -> int:
    """Qwen2-VL family: one token per ``merge_size x merge_size`` block of patches (the image processor's)."""
    if PIXEL_VALUES not in spec:
        raise InvalidRequest(f"An image has no '{PIXEL_VALUES}' tensor; it was not made by this preprocessor.")
    patches = spec[PIXEL_VALUES][1][0]
    merge = int(pre.image_processor.merge_size) ** 2
    if patches <= 0 or patches % merge:
        raise InvalidRequest(f"An image has {patches} patches, not a positive multiple of {merge}.")
    return patches // merge


def _clip_patches(pre: HFPreprocessor, spec: ImageTensorSpec) -> int:
    """LLaVA-1.5, as LlavaProcessor counts: one token per patch of the fixed-size CLIP input, plus
    ``num_additional_image_tokens`` (the CLS feature), less one when the model drops it
    (``vision_feature_select_strategy`` "default"). Each setting from processor_config.json, else from
    the model config (the CLS feature: CLIP has one)."""
    if PIXEL_VALUES not in spec or len(spec[PIXEL_VALUES][1]) != 4:
        raise InvalidRequest(f"An image has no 4-D '{PIXEL_VALUES}' tensor; it was not made by this preprocessor.")
    _, _, height, width = spec[PIXEL_VALUES][1]
    config, settings = pre._config, pre.processor_settings
    patch = int(settings.get("patch_size") or config.vision_config.patch_size)
    extra = int(settings.get("num_additional_image_tokens", 1))
    strategy = settings.get("vision_feature_select_strategy") or config.vision_feature_select_strategy
    return (height // patch) * (width // patch) + extra - (1 if strategy == "default" else 0)


# Idefics3's tile grid, said in a tensor's *shape* (rows + 1, cols + 1): the prompt builder sees the
# shapes of an image's cached tensors only (invariant 2), and the number of tiles alone cannot tell
# 2 x 3 from 3 x 2. The tensor is a few zero bytes in the arena; the worker checks it against the tiles.
TILE_GRID = "tile_grid"


def _idefics3_outputs(pre: HFPreprocessor, out: dict[str, Any]) -> dict[str, Any]:
    """Idefics3: the processor's ``rows``/``cols`` (values) become TILE_GRID's shape."""
    arrays = dict(out)
    rows, cols = int(np.asarray(arrays.pop("rows")).reshape(-1)[0]), int(np.asarray(arrays.pop("cols")).reshape(-1)[0])
    arrays[TILE_GRID] = np.zeros((rows + 1, cols + 1), dtype=np.uint8)
    # One image, so the batch axis goes (the content cache's index holds tensors of at most 4 axes;
    # the worker puts it back); the mask as bool (the processor's int64 is 8x the bytes).
    arrays[PIXEL_VALUES] = np.asarray(arrays[PIXEL_VALUES])[0]
    arrays["pixel_attention_mask"] = np.asarray(arrays["pixel_attention_mask"])[0].astype(bool)
    return arrays


def _idefics3_expand(pre: HFPreprocessor, spec: ImageTensorSpec) -> list[int]:
    """Idefics3's text for one image (as ``Idefics3Processor.replace_image_token``), tokenized: one
    ``<fake_token_around_image><row_i_col_j>`` + ``image_seq_len`` ``<image>`` per tile, a newline per
    row, then the global view. Special tokens bound it on both sides, so tokenizing it alone gives the
    ids tokenizing the whole prompt would (a "\n\n" inside it is one token either way)."""
    if TILE_GRID not in spec or PIXEL_VALUES not in spec or len(spec[TILE_GRID][1]) != 2:
        raise InvalidRequest(f"An image has no '{TILE_GRID}' tensor; it was not made by this preprocessor.")
    rows, cols = spec[TILE_GRID][1][0] - 1, spec[TILE_GRID][1][1] - 1
    tiles = spec[PIXEL_VALUES][1][0] if len(spec[PIXEL_VALUES][1]) == 4 else -1
    if tiles != (rows * cols + 1 if rows * cols else 1) or (rows == 0) != (cols == 0):
        raise InvalidRequest("An image's tiles do not match its tile grid.")
    return pre.expansion_ids(rows, cols)


def _idefics3_text(
    rows: int,
    cols: int,
    seq_len: int,
    fake: str = "<fake_token_around_image>",
    image_token: str = "<image>",
    global_image: str = "<global-img>",
) -> str:
    image = image_token * seq_len
    glob = f"{fake}{global_image}{image}{fake}"
    if rows == 0:
        return glob
    lines = ["".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n" for r in range(rows)]
    return "".join(lines) + "\n" + glob


# LLaVA-NeXT's image token count, said as a shape: it depends on the original image size (the
# ``image_sizes`` *values*), which the prompt builder never reads. Zero bytes of uint8, one per token
# (a few KB beside megabytes of tiles); the worker checks it against image_sizes.
IMAGE_TOKENS = "image_token_count"


def _llava_next_outputs(pre: HFPreprocessor, out: dict[str, Any]) -> dict[str, Any]:
    """LLaVA-NeXT: tiles without the batch axis (the cache index holds at most 4 axes), image_sizes
    as the processor gives them, and IMAGE_TOKENS computed by transformers' LlavaNextProcessor."""
    pixels = np.asarray(out[PIXEL_VALUES])[0]
    height, width = (int(v) for v in np.asarray(out["image_sizes"]).reshape(-1)[:2])
    count = pre.llava_next_tokens(height, width, pixels.shape[-2], pixels.shape[-1])
    return {PIXEL_VALUES: pixels, "image_sizes": out["image_sizes"], IMAGE_TOKENS: np.zeros(count, np.uint8)}


def _counted_tokens(pre: HFPreprocessor, spec: ImageTensorSpec) -> int:
    if IMAGE_TOKENS not in spec or len(spec[IMAGE_TOKENS][1]) != 1:
        raise InvalidRequest(f"An image has no '{IMAGE_TOKENS}' tensor; it was not made by this preprocessor.")
    return spec[IMAGE_TOKENS][1][0]


def _siglip_patches(pre: HFPreprocessor, spec: ImageTensorSpec) -> int:
    """PaliGemma: the image processor's ``image_seq_length`` (what PaliGemmaProcessor reads), else one
    token per patch of the fixed-size SigLIP input (no CLS)."""
    if PIXEL_VALUES not in spec or len(spec[PIXEL_VALUES][1]) != 4:
        raise InvalidRequest(f"An image has no 4-D '{PIXEL_VALUES}' tensor; it was not made by this preprocessor.")
    configured = getattr(pre.image_processor, "image_seq_length", None)
    if configured:
        return int(configured)
    _, _, height, width = spec[PIXEL_VALUES][1]
    patch = int(pre._config.vision_config.patch_size)
    return (height // patch) * (width // patch)


# InternVLProcessor's image_seq_length when processor_config.json has none (the model config's own
# copy is not what the processor reads, and checkpoints leave it stale).
INTERNVL_SEQ_LENGTH = 256


def _internvl_expand(pre: HFPreprocessor, spec: ImageTensorSpec) -> list[int]:
    """InternVL: ``<img>`` + image_seq_length ``<IMG_CONTEXT>`` per crop (rows of pixel_values) + ``</img>``
    (InternVLProcessor.replace_image_token; special tokens all, so ids splice as text would tokenize).
    image_seq_length is processor_config.json's and the three tokens are the tokenizer's named ones,
    as InternVLProcessor reads them."""
    if PIXEL_VALUES not in spec or len(spec[PIXEL_VALUES][1]) != 4 or spec[PIXEL_VALUES][1][0] <= 0:
        raise InvalidRequest(f"An image has no 4-D '{PIXEL_VALUES}' tensor; it was not made by this preprocessor.")
    start, context, end = (
        pre.named_token_id(attribute, default)
        for attribute, default in (
            ("start_image_token", "<img>"),
            ("context_image_token", "<IMG_CONTEXT>"),
            ("end_image_token", "</img>"),
        )
    )
    per_crop = int(pre.processor_settings.get("image_seq_length", INTERNVL_SEQ_LENGTH))
    return [start, *[context] * (per_crop * spec[PIXEL_VALUES][1][0]), end]


# PaliGemma checkpoints mostly carry no chat template: then the prompt is the images' placeholders and
# the text parts of a conversation of one user turn, joined. PaliGemmaProcessor then puts BOS after the
# last placeholder and "\n" at the end of whatever prompt it is given, template or not; so does
# ``_paligemma_layout``.
PALIGEMMA_TEMPLATE = (
    "{% if messages | length != 1 or messages[0]['role'] != 'user' %}"
    "{{ raise_exception('PaliGemma answers a single user message') }}{% endif %}"
    "{% set content = messages[0]['content'] %}"
    "{% if content is string %}{{ content }}"
    "{% else %}{% for part in content %}{% if part['type'] == 'image' %}<image>{% endif %}{% endfor %}"
    "{% for part in content %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
)
PALIGEMMA_SUFFIX = "\n"  # tokenized together with the text before it (".\n" can be one token)


# Keyed by the prompt style a family's record names (shared/hf_families.py): the code behind each.
_ARCHITECTURES: dict[PromptStyle, _Architecture] = {
    PromptStyle.MERGED_PATCHES: _Architecture("<|image_pad|>", _merged_patches, _qwen_low_detail),  # the Qwen family
    PromptStyle.CLIP_PATCHES: _Architecture("<image>", _clip_patches),  # LLaVA-1.5
    # Idefics3 and SmolVLM2: tiles of max_image_size plus a global view; "low" detail is the global view alone.
    PromptStyle.TILES: _Architecture(
        "<image>",
        lambda pre, spec: 0,
        lambda ip: {"do_image_splitting": False},
        _idefics3_expand,
        (("return_row_col_info", True),),
        _idefics3_outputs,
    ),
    # InternVL (transformers format): 1..max_patches crops plus a thumbnail, each image_seq_length tokens
    # between <img> and </img>; "low" detail is the thumbnail alone.
    PromptStyle.CROPS: _Architecture(
        "<IMG_CONTEXT>",
        lambda pre, spec: 0,
        lambda ip: {"crop_to_patches": False},
        _internvl_expand,
        outputs=lambda pre, out: {PIXEL_VALUES: out[PIXEL_VALUES]},
        token_attribute="context_image_token",
    ),
    # PaliGemma: a fixed-size SigLIP view per image, image_seq_length tokens.
    PromptStyle.SIGLIP_PATCHES: _Architecture("<image>", _siglip_patches),
    # Gemma 3: a fixed-size SigLIP view per image (pan-and-scan crops are not carried: off by default).
    PromptStyle.WRAPPED: _Architecture(
        "<start_of_image>",
        lambda pre, spec: 0,
        outputs=lambda pre, out: {PIXEL_VALUES: out[PIXEL_VALUES]},
        wrapped=("<start_of_image>", "<image_soft_token>", "<end_of_image>"),
        token_attribute="boi_token",
    ),
    # LLaVA-NeXT: any-resolution tiles plus an overview; token count from the original size.
    PromptStyle.COUNTED: _Architecture("<image>", _counted_tokens, outputs=_llava_next_outputs),
}


def _processor_settings(path: str) -> dict[str, Any]:
    """processor_config.json: the arguments ``from_pretrained`` gives the processor class ({} without one)."""
    config_file = os.path.join(path, "processor_config.json")
    if not os.path.isfile(config_file):
        return {}
    with open(config_file, encoding="utf-8") as f:
        settings = json.load(f)
    return settings if isinstance(settings, dict) else {}


def _llava_next_processor(path: str, pre: HFPreprocessor) -> Any:
    """transformers' LlavaNextProcessor over our image processor and tokenizer, with the checkpoint's
    processor_config.json (patch size, CLS handling), for its token count only."""
    from transformers import LlavaNextProcessor

    settings = pre.processor_settings
    model = pre._config
    return LlavaNextProcessor(
        pre.image_processor,
        pre.tokenizer,
        patch_size=settings.get("patch_size", model.vision_config.patch_size),
        vision_feature_select_strategy=settings.get(
            "vision_feature_select_strategy", model.vision_feature_select_strategy
        ),
        num_additional_image_tokens=settings.get("num_additional_image_tokens", 1),
    )


def _special_wrapping(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text when asked for special tokens (BOS for
    Llama- and Gemma-style tokenizers, nothing for Qwen's): found by encoding a probe both ways."""
    plain = [int(i) for i in tokenizer.encode("a", add_special_tokens=False)]
    full = [int(i) for i in tokenizer.encode("a", add_special_tokens=True)]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []


def _idefics3_seq_len(config: Any) -> int:
    """Image tokens per tile: the tower's patches, pixel-shuffled by ``scale_factor`` in each direction."""
    side = int(config.vision_config.image_size) // int(config.vision_config.patch_size)
    return side * side // int(config.scale_factor) ** 2


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
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        kind = type(self.image_processor).__name__.removesuffix("Pil").removesuffix("Fast")
        if kind not in family.image_processors:
            raise ValueError(
                f"{path}: image processor {kind} is not supported for model_type {family.model_type!r}; "
                f"known: {', '.join(family.image_processors)}"
            )
        self._arch = _ARCHITECTURES[family.prompt]
        self.processor_settings = _processor_settings(path)
        self._image_token_id = self.named_token_id(self._arch.token_attribute, self._arch.image_token)
        # Video (gateway/preprocess/qwen_video.py): Qwen2-VL only; -1 matches no token id.
        self._video: VideoSettings | None = None
        self._video_token_id = -1
        if family.model_type in VIDEO_FAMILIES:
            self._video = VideoSettings.from_checkpoint(path, self.image_processor)
            self._video_token_id = self.named_token_id("video_token", "<|video_pad|>")
        # Some checkpoints keep the (multimodal) template beside the processor only.
        self.tokenizer.chat_template = _processor_chat_template(path) or self.tokenizer.chat_template
        self._prefix_lm_prompt = family.prefix_lm_prompt
        if not self.tokenizer.chat_template and self._prefix_lm_prompt:
            self.tokenizer.chat_template = PALIGEMMA_TEMPLATE
        # What the processor's tokenizer call adds around a prompt (BOS, for many), unless the template
        # wrote BOS itself; PaliGemmaProcessor turns it off and places BOS itself.
        self._wrapping = ([], []) if self._prefix_lm_prompt else _special_wrapping(self.tokenizer)
        self._added_ids = np.asarray(sorted(self.tokenizer.added_tokens_decoder), dtype=np.int32)
        if not self.tokenizer.chat_template:
            raise ValueError(f"{path}: no chat template (chat_template.jinja / .json or tokenizer_config.json)")
        self._config = AutoConfig.from_pretrained(path)
        text_config = self._config.get_text_config()
        self.max_prompt_tokens = getattr(text_config, "max_position_embeddings", None)
        # gateway/fields.py: token-level request fields are honoured only by a model that samples tokens
        # (not checksum:hf:), and their token ids must be below this.
        self.samples_tokens = samples_tokens
        self.vocab_size = int(text_config.vocab_size)
        self._tokenizer_lock = threading.Lock()
        self._expansions: dict[tuple[int, int], list[int]] = {}
        self._llava_next: Any = _llava_next_processor(path, self) if family.prompt is PromptStyle.COUNTED else None
        self._cache_params = self._describe_processing()

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

    def preprocess_video(self, data: bytes, allocate: AllocateFn, reserve: Any) -> None:
        """Probe, sample, decode and patch a video (gateway/preprocess/qwen_video.py)."""
        if self._video is None:
            super().preprocess_video(data, allocate, reserve)
            return
        preprocess_video(data, self._video, allocate, reserve)

    def image_options(self, request_kwargs: dict[str, Any] | None, detail: str | None) -> dict[str, Any]:
        """One image's processor arguments: ``image_url.detail`` ("low": the architecture's low setting;
        "high", "auto" or none: the configured processor), then the request's ``mm_processor_kwargs``
        on top. Raises InvalidRequest naming ``mm_processor_kwargs`` for a key the processor does not
        accept (or one in FIXED_PROCESSOR_KEYS)."""
        options = self._arch.low_detail(self.image_processor) if detail == "low" else {}
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
        """The Qwen2-VL family (a pixel budget in ``size``): the resized image's tokens, computed as its
        processor will resize it (``smart_resize``), refused when they alone fill the context; and the
        processor's float32 copies of it (about five: the resize, rescale, normalise and the patches).
        Other processors resize to a fixed size: nothing to plan."""
        size = {**_size_of(self.image_processor), **((options or {}).get("size") or {})}
        merge = getattr(self.image_processor, "merge_size", None)
        if not merge or "longest_edge" not in size or "shortest_edge" not in size:
            return 0
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        patch = int(self.image_processor.patch_size)
        try:
            h, w = smart_resize(height, width, patch * merge, size["shortest_edge"], size["longest_edge"])
        except ValueError as exc:  # e.g. an aspect ratio above 200:1
            raise UndecodableImage(f"The image cannot be processed for this model: {exc}") from None
        tokens = h * w // (patch * patch * merge * merge)
        if self.max_prompt_tokens is not None and tokens >= self.max_prompt_tokens:
            raise InvalidRequest(
                f"This image alone would take {tokens} tokens; this model reads at most "
                f"{self.max_prompt_tokens - 1}. Send a smaller image or a lower max_pixels."
            )
        return 5 * h * w * 3 * 4

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
                **dict(self._arch.call_args),
                **(options or {}),
            )
        except _OPTION_ERRORS as exc:
            raise InvalidRequest(
                f"mm_processor_kwargs are not valid for this processor: {exc}", param="mm_processor_kwargs"
            ) from None
        except ValueError as exc:  # e.g. Qwen2-VL refuses aspect ratios above 200:1
            raise UndecodableImage(f"The image cannot be processed for this model: {exc}") from None
        arrays = {name: np.ascontiguousarray(value) for name, value in self._arch.outputs(self, out).items()}
        for name, array in arrays.items():
            destination = allocate(name, array.dtype.name, tuple(array.shape))
            np.copyto(destination, array, casting="no")

    def build_prompt(self, messages: Sequence[dict[str, Any]], images: Sequence[ImageTensorSpec]) -> PromptInputs:
        """Render the chat template, tokenize, and expand each image placeholder.

        Returns int32 token ids as ``inline`` and the rendered prompt (one placeholder per
        image) as ``text``. Raises InvalidRequest when the template rejects the
        conversation, when the image parts and ``images`` differ in number, or when the
        prompt leaves the model no room to answer.
        """
        ids, expanded = self._prompt_ids(messages, images)
        if self.max_prompt_tokens is not None and len(expanded) >= self.max_prompt_tokens:
            raise InvalidRequest(
                f"The prompt is {len(expanded)} tokens (images included); this model reads at most "
                f"{self.max_prompt_tokens - 1} before answering. Shorten the conversation or send smaller images."
            )
        with self._tokenizer_lock:
            text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        return PromptInputs(inline=expanded.tobytes(), text=text, prompt_tokens=len(expanded))

    def prompt_token_ids(self, messages: Sequence[dict[str, Any]], images: Sequence[ImageTensorSpec]) -> list[int]:
        """The prompt's token ids exactly as the model reads them (image tokens expanded), with no
        length check: what ``POST /tokenize`` answers (gateway/tokenize.py). Raises InvalidRequest."""
        return [int(i) for i in self._prompt_ids(messages, images)[1]]

    def text_token_ids(self, text: str) -> list[int]:
        """Plain text's token ids as the tokenizer gives them (special tokens added): ``POST /tokenize``
        with a ``prompt``."""
        with self._tokenizer_lock:
            return [int(i) for i in self.tokenizer.encode(text)]

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens included). Raises InvalidRequest for an id outside the vocabulary."""
        vocab = self.vocab_size or 0  # always set here (from the text config)
        if any(not 0 <= i < vocab for i in ids):
            raise InvalidRequest(f"a token id is outside the vocabulary (0..{vocab - 1})", param="tokens")
        with self._tokenizer_lock:
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def llava_next_tokens(self, height: int, width: int, tile_height: int, tile_width: int) -> int:
        """LLaVA-NeXT: image tokens of an image of the original ``height`` x ``width``, exactly as
        ``LlavaNextProcessor`` counts them (its own method: the unpadding arithmetic is subtle)."""
        count = int(self._llava_next._get_number_of_features(height, width, tile_height, tile_width))
        return count - (1 if self._llava_next.vision_feature_select_strategy == "default" else 0)

    def expansion_ids(self, rows: int, cols: int) -> list[int]:
        """Idefics3: the token ids of one image with a ``rows`` x ``cols`` tile grid (memoised; call
        without the tokenizer lock held)."""
        key = (rows, cols)
        if key not in self._expansions:
            seq_len = int(self.processor_settings.get("image_seq_len") or _idefics3_seq_len(self._config))
            names = tuple(
                getattr(self.tokenizer, attribute, None) or default
                for attribute, default in (
                    ("fake_image_token", "<fake_token_around_image>"),
                    ("image_token", "<image>"),
                    ("global_image_token", "<global-img>"),
                )
            )
            with self._tokenizer_lock:
                ids = self.tokenizer.encode(_idefics3_text(rows, cols, seq_len, *names), add_special_tokens=False)
            self._expansions[key] = [int(i) for i in ids]
        return self._expansions[key]

    def named_token_id(self, attribute: str, default: str) -> int:
        """The id of the tokenizer's named token ``attribute`` (``tokenizer.image_token``, ...), the name
        a processor class reads, else of ``default``."""
        name = getattr(self.tokenizer, attribute, None) or default
        return int(self.tokenizer.convert_tokens_to_ids(name))

    def _with_special_tokens(self, ids: np.ndarray) -> np.ndarray:
        """The template's ids as the processor's tokenizer call would give them: its special tokens
        around them (``_special_wrapping``), unless the template starts with BOS (the processor's
        ``apply_chat_template`` then adds none)."""
        prefix, suffix = self._wrapping
        if (not prefix and not suffix) or (len(ids) and ids[0] == self.tokenizer.bos_token_id):
            return ids
        return np.concatenate([np.asarray(prefix, np.int32), ids, np.asarray(suffix, np.int32)])

    def _paligemma_layout(self, ids: np.ndarray) -> np.ndarray:
        """PaliGemmaProcessor's layout, on ids: BOS right after the last image placeholder, and "\n" at
        the end, tokenized together with the text since the last added token (added tokens split a
        text, so only that run can merge with it; control tokens the user wrote are text there)."""
        slots = np.flatnonzero(ids == self._image_token_id)
        start = int(slots[-1]) + 1 if len(slots) else 0
        added = np.flatnonzero(np.isin(ids[start:], self._added_ids))
        run = start + (int(added[-1]) + 1 if len(added) else 0)
        with self._tokenizer_lock:
            text = str(
                self.tokenizer.decode(ids[run:].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
            )
            tail = self.tokenizer.encode(text + PALIGEMMA_SUFFIX, add_special_tokens=False, split_special_tokens=True)
        bos = [int(self.tokenizer.bos_token_id)] if self.tokenizer.bos_token_id is not None else []
        return np.concatenate(
            [ids[:start], np.asarray(bos, np.int32), ids[start:run], np.asarray(tail, np.int32)]
        ).astype(np.int32)

    def _wrap_images(self, ids: list[int]) -> list[int]:
        """Gemma 3: what Gemma3Processor's text replacement gives, done on ids (the user's text stays
        tokenized with control tokens as text): each placeholder becomes "\n\n" <boi> N x <image> <eoi>
        "\n\n", and those newlines are tokenized together with the newline tokens next to them, as they
        would be in one string (a "\n" before an image and the "\n\n" become one "\n\n\n" token)."""
        assert self._arch.wrapped is not None
        boi, image, eoi = (
            self.named_token_id(attribute, default)
            for attribute, default in zip(("boi_token", "image_token", "eoi_token"), self._arch.wrapped)
        )
        seq_len = int(self.processor_settings.get("image_seq_length") or self._config.mm_tokens_per_image)
        with self._tokenizer_lock:
            newline: dict[int, str] = {t: str(self.tokenizer.decode([t])) for t in set(ids)}
            out: list[int] = []
            pending = ""

            def flush() -> None:
                nonlocal pending
                if pending:
                    out.extend(int(i) for i in self.tokenizer.encode(pending, add_special_tokens=False))
                    pending = ""

            for t in ids:
                if t == boi:
                    run = ""  # the newline tokens just before it (none when pending holds an image's tail)
                    while out and set(newline.get(out[-1], "x")) == {"\n"}:
                        run = newline[out.pop()] + run
                    pending += run + "\n\n"
                    flush()
                    out += [boi, *[image] * seq_len, eoi]
                    pending = "\n\n"
                elif pending and set(newline[t]) == {"\n"}:
                    pending += newline[t]
                else:
                    flush()
                    out.append(t)
            flush()
        return out

    def _prompt_ids(
        self, messages: Sequence[dict[str, Any]], images: Sequence[ImageTensorSpec]
    ) -> tuple[np.ndarray, np.ndarray]:
        """(the template's ids with one placeholder per image, the ids with every placeholder expanded)."""
        import jinja2

        try:
            with self._tokenizer_lock:
                encoded = self.tokenizer.apply_chat_template(
                    list(messages),
                    tokenize=True,
                    add_generation_prompt=True,
                    sanitize_control_tokens=True,
                    return_dict=True,
                )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise InvalidRequest(f"The conversation does not fit this model's chat template: {exc}") from None
        ids = np.asarray(encoded["input_ids"], dtype=np.int32)
        ids = self._paligemma_layout(ids) if self._prefix_lm_prompt else self._with_special_tokens(ids)
        is_video = ids == self._video_token_id  # video parts: gateway/preprocess/qwen_video.py
        slots = np.flatnonzero((ids == self._image_token_id) | is_video)
        if len(slots) != len(images):
            raise InvalidRequest(f"The messages hold {len(slots)} image parts but {len(images)} images were sent.")
        if [bool(v) for v in is_video[slots]] != [PIXEL_VALUES_VIDEOS in spec for spec in images]:
            raise InvalidRequest("The messages' image and video parts do not match the images and videos sent.")
        if self._arch.wrapped is not None:
            for spec in images:
                if PIXEL_VALUES not in spec or len(spec) != 1:
                    raise InvalidRequest("An image's tensors were not made by this preprocessor.")
            return ids, np.asarray(self._wrap_images(ids.tolist()), dtype=np.int32)
        if self._arch.expand is not None:
            parts = np.split(ids, slots)  # each later part starts with its image's placeholder
            pieces = [parts[0]] + [
                np.concatenate([np.asarray(self._arch.expand(self, spec), dtype=np.int32), part[1:]])
                for spec, part in zip(images, parts[1:])
            ]
            return ids, np.concatenate(pieces).astype(np.int32)
        repeats = np.ones(len(ids), dtype=np.int64)
        repeats[slots] = [
            video_tokens(spec, self._video)
            if self._video and PIXEL_VALUES_VIDEOS in spec
            else self._arch.tokens_per_image(self, spec)
            for spec in images
        ]
        return ids, np.repeat(ids, repeats)
