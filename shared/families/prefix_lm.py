"""PaliGemma's style: a fixed-size SigLIP view per image, the whole prompt a prefix, positions from 1.

Frontend half: ``image_seq_length`` ``<image>`` tokens per image; PaliGemmaProcessor's layout (BOS
right after the last placeholder, "\n" at the end) on ids, and a plain template (one user turn: the
images' placeholders, then its text) when the checkpoint carries none. Worker half: one float (1, 3,
S, S) view per image (fixed_size.py's check), ``token_type_ids`` 0 over the prompt (it attends both
ways; a recomputed row's generated tokens are not prefix), 1-D positions counted from 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shmgate.shared.errors import InvalidRequest
from shmgate.shared.families.base import (
    PIXEL_VALUES,
    FamilyStyle,
    ImageSpec,
    InputLayout,
    ItemTensors,
    ModelInputs,
    PromptContext,
    repeat_placeholders,
)
from shmgate.shared.families.fixed_size import check_fixed_size

if TYPE_CHECKING:
    import torch

__all__ = ["PALIGEMMA_SUFFIX", "PALIGEMMA_TEMPLATE", "STYLE", "PrefixLM"]

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


def _siglip_patches(pre: PromptContext, spec: ImageSpec) -> int:
    """PaliGemma: the image processor's ``image_seq_length`` (what PaliGemmaProcessor reads), else one
    token per patch of the fixed-size SigLIP input (no CLS)."""
    if PIXEL_VALUES not in spec or len(spec[PIXEL_VALUES][1]) != 4:
        raise InvalidRequest(f"An image has no 4-D '{PIXEL_VALUES}' tensor; it was not made by this preprocessor.")
    configured = getattr(pre.image_processor, "image_seq_length", None)
    if configured:
        return int(configured)
    _, _, height, width = spec[PIXEL_VALUES][1]
    patch = int(pre.model_config.vision_config.patch_size)
    return (height // patch) * (width // patch)


def _paligemma_layout(pre: PromptContext, ids: np.ndarray) -> np.ndarray:
    """PaliGemmaProcessor's layout, on ids: BOS right after the last image placeholder, and "\n" at
    the end, tokenized together with the text since the last added token (added tokens split a
    text, so only that run can merge with it; control tokens the user wrote are text there)."""
    slots = np.flatnonzero(ids == pre.image_token_id)
    start = int(slots[-1]) + 1 if len(slots) else 0
    added = np.flatnonzero(np.isin(ids[start:], pre.added_ids))
    run = start + (int(added[-1]) + 1 if len(added) else 0)
    with pre.tokenizer_lock:
        text = str(
            pre.tokenizer.decode(ids[run:].tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )
        tail = pre.tokenizer.encode(text + PALIGEMMA_SUFFIX, add_special_tokens=False, split_special_tokens=True)
    bos = [int(pre.tokenizer.bos_token_id)] if pre.tokenizer.bos_token_id is not None else []
    return np.concatenate([ids[:start], np.asarray(bos, np.int32), ids[start:run], np.asarray(tail, np.int32)]).astype(
        np.int32
    )


class PrefixLM(FamilyStyle):
    name = "prefix-lm"
    image_token = "<image>"
    image_tensors = ("pixel_values",)
    first_position = 1  # PaliGemma's positions count from 1 (and the tokens after the prompt go on from there)

    def chat_template(self) -> str | None:
        return PALIGEMMA_TEMPLATE

    def arrange(self, pre: PromptContext, ids: np.ndarray) -> np.ndarray:
        # PaliGemmaProcessor turns the tokenizer's special tokens off and places BOS itself
        return _paligemma_layout(pre, ids)

    def expand(self, pre: PromptContext, ids: np.ndarray, slots: np.ndarray, images: Sequence[ImageSpec]) -> np.ndarray:
        return repeat_placeholders(ids, slots, [_siglip_patches(pre, spec) for spec in images])

    def layout(self, config: Any, common: dict[str, Any]) -> InputLayout:
        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        return InputLayout(self, **common, image_size=vision.image_size, tokens_per_image=side * side)

    def check(
        self,
        layout: InputLayout,
        item: ItemTensors,
        ids: np.ndarray,
        pixels: list[torch.Tensor],
        grids: list[torch.Tensor],
        device: torch.device,
    ) -> ModelInputs:
        return check_fixed_size(layout, item, ids, pixels, grids, device)

    def extra_inputs(self, layout: InputLayout, ids: torch.Tensor, prompt_tokens: int) -> dict[str, Any]:
        # the prompt is the prefix (a recomputed row's tokens are not)
        import torch

        return {"token_type_ids": (torch.arange(ids.shape[1], device=ids.device) >= prompt_tokens).view(1, -1).long()}


STYLE = PrefixLM()
