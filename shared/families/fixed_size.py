"""LLaVA-1.5's style: one fixed-size CLIP view per image, 1-D positions.

Frontend half: one ``<image>`` per patch of the fixed-size view, plus the CLS feature unless the
model drops it, counted from the tensor's shape as LlavaProcessor counts. Worker half: each image one
float (1, 3, S, S) tensor of the tower's side S (``check_fixed_size``, which Gemma 3's and
PaliGemma's styles share), positions 0..L-1 and no offset after the prompt.
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

if TYPE_CHECKING:
    import torch

__all__ = ["STYLE", "FixedSize", "check_fixed_size"]


def _clip_patches(pre: PromptContext, spec: ImageSpec) -> int:
    """LLaVA-1.5, as LlavaProcessor counts: one token per patch of the fixed-size CLIP input, plus
    ``num_additional_image_tokens`` (the CLS feature), less one when the model drops it
    (``vision_feature_select_strategy`` "default"). Each setting from processor_config.json, else from
    the model config (the CLS feature: CLIP has one)."""
    if PIXEL_VALUES not in spec or len(spec[PIXEL_VALUES][1]) != 4:
        raise InvalidRequest(f"An image has no 4-D '{PIXEL_VALUES}' tensor; it was not made by this preprocessor.")
    _, _, height, width = spec[PIXEL_VALUES][1]
    config, settings = pre.model_config, pre.processor_settings
    patch = int(settings.get("patch_size") or config.vision_config.patch_size)
    extra = int(settings.get("num_additional_image_tokens", 1))
    strategy = settings.get("vision_feature_select_strategy") or config.vision_feature_select_strategy
    return (height // patch) * (width // patch) + extra - (1 if strategy == "default" else 0)


def check_fixed_size(
    layout: InputLayout,
    item: ItemTensors,
    ids: np.ndarray,
    pixels: list[torch.Tensor],
    grids: list[torch.Tensor],
    device: torch.device,
) -> ModelInputs:
    """Each image is one float (1, 3, S, S) tensor of the tower's size S, worth ``tokens_per_image``."""
    import torch

    rid = item.request_id
    shape = (1, 3, layout.image_size, layout.image_size)
    if grids or any(not p.is_floating_point() or tuple(p.shape) != shape for p in pixels):
        raise InvalidRequest(f"Request {rid}: each image must be one float pixel_values tensor of shape {shape}.")
    if int((ids == layout.image_token_id).sum()) != len(pixels) * layout.tokens_per_image:
        raise InvalidRequest(f"Request {rid}: the prompt's image slots do not match its images.")
    input_ids = torch.from_numpy(ids.astype(np.int64)).view(1, -1).to(device)
    return ModelInputs(input_ids, torch.cat(pixels).to(device) if pixels else None, None)


class FixedSize(FamilyStyle):
    name = "fixed-size"
    image_token = "<image>"
    image_tensors = ("pixel_values",)

    def expand(self, pre: PromptContext, ids: np.ndarray, slots: np.ndarray, images: Sequence[ImageSpec]) -> np.ndarray:
        return repeat_placeholders(ids, slots, [_clip_patches(pre, spec) for spec in images])

    def layout(self, config: Any, common: dict[str, Any]) -> InputLayout:
        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        extra = 0 if config.vision_feature_select_strategy == "default" else 1  # the CLS feature
        return InputLayout(self, **common, image_size=vision.image_size, tokens_per_image=side * side + extra)

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


STYLE = FixedSize()
