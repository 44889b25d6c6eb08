"""InternVL's style: 1..max_patches crops plus a thumbnail per image, 1-D positions.

Frontend half: ``<img>`` + image_seq_length ``<IMG_CONTEXT>`` per crop + ``</img>``
(InternVLProcessor.replace_image_token), image_seq_length from processor_config.json;
``image_url.detail: "low"`` is the thumbnail alone. Worker half: each image float (n, 3, S, S) crops
of the tower's side S, ``tokens_per_image`` each, computed from the tower's geometry as the model
computes its features.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    splice_images,
)

if TYPE_CHECKING:
    import torch

__all__ = ["INTERNVL_SEQ_LENGTH", "STYLE", "Crops"]

# InternVLProcessor's image_seq_length when processor_config.json has none (the model config's own
# copy is not what the processor reads, and checkpoints leave it stale).
INTERNVL_SEQ_LENGTH = 256


def _internvl_expand(pre: PromptContext, spec: ImageSpec) -> list[int]:
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


class Crops(FamilyStyle):
    name = "crops"
    image_token = "<IMG_CONTEXT>"
    token_attribute = "context_image_token"
    image_tensors = ("pixel_values",)

    def low_detail(self, image_processor: Any) -> dict[str, Any]:
        return {"crop_to_patches": False}

    def outputs(self, pre: PromptContext, out: Mapping[str, Any]) -> dict[str, Any]:
        return {PIXEL_VALUES: out[PIXEL_VALUES]}

    def expand(self, pre: PromptContext, ids: np.ndarray, slots: np.ndarray, images: Sequence[ImageSpec]) -> np.ndarray:
        return splice_images(ids, slots, [_internvl_expand(pre, spec) for spec in images])

    def layout(self, config: Any, common: dict[str, Any]) -> InputLayout:
        # Tokens per crop from the tower's geometry, as the model computes its features: the config's
        # image_seq_length is a copy of the processor's setting that the model never reads (stale in
        # checkpoints whose processor was changed).
        vision = config.vision_config
        patch = vision.patch_size
        side = int(vision.image_size if isinstance(vision.image_size, int) else vision.image_size[0])
        patch_side = int(patch if isinstance(patch, int) else patch[0])
        return InputLayout(
            self,
            **common,
            image_size=side,
            tokens_per_image=int((side // patch_side) ** 2 * config.downsample_ratio**2),
        )

    def check(
        self,
        layout: InputLayout,
        item: ItemTensors,
        ids: np.ndarray,
        pixels: list[torch.Tensor],
        grids: list[torch.Tensor],
        device: torch.device,
    ) -> ModelInputs:
        """Each image is float (n, 3, S, S) crops of the tower's side S, ``tokens_per_image`` each."""
        import torch

        rid = item.request_id
        side = layout.image_size
        if grids or any(
            not p.is_floating_point() or p.dim() != 4 or p.shape[0] == 0 or tuple(p.shape[1:]) != (3, side, side)
            for p in pixels
        ):
            raise InvalidRequest(
                f"Request {rid}: each image must be float pixel_values of shape (n, 3, {side}, {side})."
            )
        if int((ids == layout.image_token_id).sum()) != sum(p.shape[0] for p in pixels) * layout.tokens_per_image:
            raise InvalidRequest(f"Request {rid}: the prompt's image slots do not match its images' crops.")
        input_ids = torch.from_numpy(ids.astype(np.int64)).view(1, -1).to(device)
        return ModelInputs(input_ids, torch.cat(pixels).to(device) if pixels else None, None)


STYLE = Crops()
