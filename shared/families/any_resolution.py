"""LLaVA-NeXT's style: any-resolution tiles fitted to grid_pinpoints, 1-D positions.

Frontend half: an image's token count depends on its original size (the ``image_sizes`` *values*,
which the prompt builder never reads), so it is computed at decode time by transformers'
LlavaNextProcessor and said as a shape (IMAGE_TOKENS). Worker half: per image, float pixel_values
(n, 3, S, S) with n the tiles its image_sizes ask for, stacked and padded with empty tiles to the
most tiles (as the processor pads a batch; the model drops them by image_sizes).
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
    repeat_placeholders,
)

if TYPE_CHECKING:
    import torch

__all__ = ["IMAGE_TOKENS", "STYLE", "AnyResolution"]

# LLaVA-NeXT's image token count, said as a shape: it depends on the original image size (the
# ``image_sizes`` *values*), which the prompt builder never reads. Zero bytes of uint8, one per token
# (a few KB beside megabytes of tiles); the worker checks it against image_sizes.
IMAGE_TOKENS = "image_token_count"


def _llava_next_processor(pre: PromptContext) -> Any:
    """transformers' LlavaNextProcessor over our image processor and tokenizer, with the checkpoint's
    processor_config.json (patch size, CLS handling), for its token count only."""
    from transformers import LlavaNextProcessor

    settings = pre.processor_settings
    model = pre.model_config
    return LlavaNextProcessor(  # type: ignore[no-untyped-call]
        pre.image_processor,
        pre.tokenizer,
        patch_size=settings.get("patch_size", model.vision_config.patch_size),
        vision_feature_select_strategy=settings.get(
            "vision_feature_select_strategy", model.vision_feature_select_strategy
        ),
        num_additional_image_tokens=settings.get("num_additional_image_tokens", 1),
    )


def llava_next_tokens(pre: PromptContext, height: int, width: int, tile_height: int, tile_width: int) -> int:
    """LLaVA-NeXT: image tokens of an image of the original ``height`` x ``width``, exactly as
    ``LlavaNextProcessor`` counts them (its own method: the unpadding arithmetic is subtle)."""
    processor = pre.style_state
    count = int(processor._get_number_of_features(height, width, tile_height, tile_width))
    return count - (1 if processor.vision_feature_select_strategy == "default" else 0)


def _llava_next_outputs(pre: PromptContext, out: Mapping[str, Any]) -> dict[str, Any]:
    """LLaVA-NeXT: tiles without the batch axis (the cache index holds at most 4 axes), image_sizes
    as the processor gives them, and IMAGE_TOKENS computed by transformers' LlavaNextProcessor."""
    pixels = np.asarray(out[PIXEL_VALUES])[0]
    height, width = (int(v) for v in np.asarray(out["image_sizes"]).reshape(-1)[:2])
    count = llava_next_tokens(pre, height, width, pixels.shape[-2], pixels.shape[-1])
    return {PIXEL_VALUES: pixels, "image_sizes": out["image_sizes"], IMAGE_TOKENS: np.zeros(count, np.uint8)}


def _counted_tokens(pre: PromptContext, spec: ImageSpec) -> int:
    if IMAGE_TOKENS not in spec or len(spec[IMAGE_TOKENS][1]) != 1:
        raise InvalidRequest(f"An image has no '{IMAGE_TOKENS}' tensor; it was not made by this preprocessor.")
    return spec[IMAGE_TOKENS][1][0]


class AnyResolution(FamilyStyle):
    name = "any-resolution"
    image_token = "<image>"
    image_tensors = ("pixel_values", "image_sizes", "image_token_count")
    host_tensors = ("image_sizes", "image_token_count")

    def prepare(self, pre: PromptContext) -> Any:
        return _llava_next_processor(pre)

    def outputs(self, pre: PromptContext, out: Mapping[str, Any]) -> dict[str, Any]:
        return _llava_next_outputs(pre, out)

    def expand(self, pre: PromptContext, ids: np.ndarray, slots: np.ndarray, images: Sequence[ImageSpec]) -> np.ndarray:
        return repeat_placeholders(ids, slots, [_counted_tokens(pre, spec) for spec in images])

    def layout(self, config: Any, common: dict[str, Any]) -> InputLayout:
        return InputLayout(
            self,
            **common,
            image_size=config.vision_config.image_size,
            grid_pinpoints=tuple((int(h), int(w)) for h, w in config.image_grid_pinpoints),
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
        """Per image: float pixel_values (n, 3, S, S) with n the tiles its image_sizes (int64 (1, 2)) asks
        for, and an image_token_count of shape (tokens,)."""
        import torch
        import torch.nn.functional as F
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        rid = item.request_id
        sizes, counts = item.tensors.get("image_sizes", []), item.tensors.get("image_token_count", [])
        if not len(pixels) == len(sizes) == len(counts) or "image_grid_thw" in item.tensors:
            raise InvalidRequest(f"Request {rid}: each image needs pixel_values, image_sizes and image_token_count.")
        side = layout.image_size
        for p, size in zip(pixels, sizes):
            if size.dtype != torch.int64 or tuple(size.shape) != (1, 2) or int(size.min()) <= 0:
                raise InvalidRequest(f"Request {rid}: image_sizes must be positive int64 (1, 2).")
            n = image_size_to_num_patches(size[0].tolist(), [list(g) for g in layout.grid_pinpoints], side)
            if not p.is_floating_point() or tuple(p.shape) != (n, 3, side, side):
                raise InvalidRequest(
                    f"Request {rid}: pixel_values must be float ({n}, 3, {side}, {side}) for "
                    f"an image of {tuple(size[0].tolist())}, got {p.dtype} {tuple(p.shape)}."
                )
        if int((ids == layout.image_token_id).sum()) != sum(c.shape[0] for c in counts):
            raise InvalidRequest(f"Request {rid}: the prompt's image slots do not match its images.")
        input_ids = torch.from_numpy(ids.astype(np.int64)).view(1, -1).to(device)
        if not pixels:
            return ModelInputs(input_ids, None, None)
        most = max(p.shape[0] for p in pixels)
        stacked = torch.stack([F.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[0])) for p in pixels])
        return ModelInputs(input_ids, stacked.to(device), None, image_sizes=torch.cat(sizes).to(device))


STYLE = AnyResolution()
