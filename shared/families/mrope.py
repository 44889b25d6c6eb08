"""The Qwen2-VL family's style (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): merged patches and 3-D positions.

Frontend half: each image is its processor's patches (``pixel_values`` float32 ``[t*h*w,
3*2*14*14]``, ``image_grid_thw`` int64 ``[1, 3]``), one ``<|image_pad|>`` token per ``merge_size x
merge_size`` block of them, counted from the tensor's rows (a shape). ``image_url.detail: "low"`` is a
pixel budget of LOW_DETAIL_TOKENS tokens; an image whose tokens alone fill the context is refused
before it is decoded (``plan_image``). Video (Qwen2-VL, Qwen2.5-VL) is laid out by the frontend's
video module (gateway/preprocess/qwen_video.py) and counted through ``PromptContext.video_tokens``.

Worker half: patches and grids checked against the prompt's slots; multimodal RoPE needs 3-D
positions for the prefill and an offset (``rope delta``) for every later token, computed here and
passed explicitly (the model would otherwise keep the delta in ``model.model.rope_deltas``, one slot
shared by every request, which interleaved requests would overwrite).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shmgate.shared.errors import InvalidRequest, UndecodableImage
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

__all__ = ["LOW_DETAIL_TOKENS", "STYLE", "MRope", "mrope_positions"]

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


def _merged_patches(pre: PromptContext, spec: ImageSpec) -> int:
    """Qwen2-VL family: one token per ``merge_size x merge_size`` block of patches (the image processor's)."""
    if PIXEL_VALUES not in spec:
        raise InvalidRequest(f"An image has no '{PIXEL_VALUES}' tensor; it was not made by this preprocessor.")
    patches = spec[PIXEL_VALUES][1][0]
    merge = int(pre.image_processor.merge_size) ** 2
    if patches <= 0 or patches % merge:
        raise InvalidRequest(f"An image has {patches} patches, not a positive multiple of {merge}.")
    return patches // merge


def _check_image(layout: InputLayout, rid: int, pixels: torch.Tensor, grid: torch.Tensor) -> int:
    """Check one image's pair of tensors; return its number of image tokens."""
    import torch

    if grid.dtype != torch.int64 or tuple(grid.shape) != (1, 3):
        raise InvalidRequest(
            f"Request {rid}: image_grid_thw must be int64 (1, 3), got {grid.dtype} {tuple(grid.shape)}."
        )
    t, h, w = (int(v) for v in grid[0].tolist())  # a host tensor (host_tensors): no device sync
    patches = t * h * w
    if min(t, h, w) <= 0 or patches % layout.merge:
        raise InvalidRequest(f"Request {rid}: bad image grid {(t, h, w)}.")
    if not pixels.is_floating_point() or tuple(pixels.shape) != (patches, layout.patch_dim):
        raise InvalidRequest(
            f"Request {rid}: pixel_values must be float ({patches}, {layout.patch_dim}), "
            f"got {pixels.dtype} {tuple(pixels.shape)}."
        )
    return patches // layout.merge


def mrope_positions(
    model: Any,
    layout: InputLayout,
    ids: torch.Tensor,
    grid: torch.Tensor | None,
    video_grid: torch.Tensor | None = None,
    seconds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """3-D positions of the prompt and the offset of the tokens after it (the model's ``get_rope_index``)."""
    import torch

    if grid is None and video_grid is None:
        positions = torch.arange(ids.shape[1], device=ids.device).view(1, 1, -1).expand(3, 1, -1)
        return positions, 0
    mm_token_type_ids = (ids == layout.image_token_id).to(torch.int32)
    mm_token_type_ids += 2 * (ids == layout.video_token_id).to(torch.int32)  # video tokens are type 2
    found, deltas = model.model.get_rope_index(
        ids,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=grid,
        video_grid_thw=video_grid,
        **({"second_per_grid_ts": seconds} if seconds is not None and layout.video_seconds else {}),
    )
    rope: torch.Tensor = found
    return rope, int(deltas.reshape(-1)[0])


class MRope(FamilyStyle):
    name = "mrope"
    image_token = "<|image_pad|>"
    image_tensors = (
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",  # video (Qwen2-VL): gateway/preprocess/qwen_video.py
        "video_grid_thw",
        "second_per_grid_ts",
    )
    host_tensors = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")

    def low_detail(self, image_processor: Any) -> dict[str, Any]:
        return _qwen_low_detail(image_processor)

    def plan_image(self, pre: PromptContext, width: int, height: int, size: dict[str, Any]) -> int:
        """A pixel budget in ``size``: the resized image's tokens, computed as its processor will resize
        it (``smart_resize``), refused when they alone fill the context; and the processor's float32
        copies of it (about five: the resize, rescale, normalise and the patches)."""
        merge = getattr(pre.image_processor, "merge_size", None)
        if not merge or "longest_edge" not in size or "shortest_edge" not in size:
            return 0
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        patch = int(pre.image_processor.patch_size)
        try:
            h, w = smart_resize(height, width, patch * merge, size["shortest_edge"], size["longest_edge"])
        except ValueError as exc:  # e.g. an aspect ratio above 200:1
            raise UndecodableImage(f"The image cannot be processed for this model: {exc}") from None
        tokens = h * w // (patch * patch * merge * merge)
        if pre.max_prompt_tokens is not None and tokens >= pre.max_prompt_tokens:
            raise InvalidRequest(
                f"This image alone would take {tokens} tokens; this model reads at most "
                f"{pre.max_prompt_tokens - 1}. Send a smaller image or a lower max_pixels."
            )
        return int(5 * h * w * 3 * 4)

    def expand(self, pre: PromptContext, ids: np.ndarray, slots: np.ndarray, images: Sequence[ImageSpec]) -> np.ndarray:
        counts = []
        for spec in images:
            video = pre.video_tokens(spec)
            counts.append(_merged_patches(pre, spec) if video is None else video)
        return repeat_placeholders(ids, slots, counts)

    def layout(self, config: Any, common: dict[str, Any]) -> InputLayout:
        vision = config.vision_config
        patch = vision.patch_size
        return InputLayout(
            self,
            **common,
            merge=vision.spatial_merge_size**2,
            patch_dim=vision.in_channels * vision.temporal_patch_size * patch * patch,
            # video: Qwen2-VL only (gateway/preprocess/qwen_video.py)
            video_token_id=int(getattr(config, "video_token_id", -1) or -1)
            if config.model_type in ("qwen2_vl", "qwen2_5_vl")
            else -1,
            video_seconds=config.model_type == "qwen2_5_vl",
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
        import torch

        rid = item.request_id
        videos, video_grids = item.tensors.get("pixel_values_videos", []), item.tensors.get("video_grid_thw", [])
        if len(pixels) != len(grids):
            raise InvalidRequest(f"Request {rid}: {len(pixels)} pixel_values but {len(grids)} image_grid_thw.")
        image_tokens = 0
        for p, g in zip(pixels, grids):
            image_tokens += _check_image(layout, rid, p, g)
        if int((ids == layout.image_token_id).sum()) != image_tokens:
            raise InvalidRequest(f"Request {rid}: the prompt's image slots do not match its images' patches.")
        if len(videos) != len(video_grids):
            raise InvalidRequest(
                f"Request {rid}: {len(videos)} pixel_values_videos, {len(video_grids)} video_grid_thw."
            )
        video_tokens = sum(_check_image(layout, rid, p, g) for p, g in zip(videos, video_grids))
        if int((ids == layout.video_token_id).sum()) != video_tokens:
            raise InvalidRequest(f"Request {rid}: the prompt's video slots do not match its videos' patches.")
        input_ids = torch.from_numpy(ids.astype(np.int64)).view(1, -1).to(device)
        inputs = ModelInputs(input_ids, None, None)
        if pixels:
            inputs = ModelInputs(input_ids, torch.cat(pixels).to(device), torch.cat(grids).to(device))
        if videos:
            seconds = item.tensors.get("second_per_grid_ts", [])
            if len(seconds) != len(videos) or any(
                s.dtype != torch.float32 or tuple(s.shape) != (1,) or not 0 < float(s[0]) < 1e4 for s in seconds
            ):
                raise InvalidRequest(f"Request {rid}: each video needs one positive float32 second_per_grid_ts.")
            inputs.pixel_values_videos = torch.cat(videos).to(device)
            inputs.video_grid_thw = torch.cat(video_grids).to(device)
            inputs.second_per_grid_ts = torch.cat(seconds).to(device)
        return inputs

    def encode_images(self, model: Any, pixels: torch.Tensor, grids: torch.Tensor) -> Sequence[torch.Tensor]:
        # Qwen2-VL's and Qwen2.5-VL's tower with its patch merger: one output per image's grid
        features: Sequence[torch.Tensor] = model.model.get_image_features(pixels, grids, return_dict=True).pooler_output
        return features

    def positions(self, model: Any, layout: InputLayout, ids: torch.Tensor, inputs: ModelInputs) -> tuple[Any, int]:
        return mrope_positions(
            model, layout, ids, inputs.image_grid_thw, inputs.video_grid_thw, inputs.second_per_grid_ts
        )


STYLE = MRope()
