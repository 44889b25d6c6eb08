"""Idefics3's and SmolVLM's style: tiles with a pixel mask and a global view, 1-D positions.

Frontend half: each image is split into rows x cols tiles of ``max_image_size`` plus a global view;
its text is a marked run of ``image_seq_len`` ``<image>`` per tile (as
``Idefics3Processor.replace_image_token``), tokenized once per grid. The grid is said in a tensor's
*shape* (TILE_GRID), since the prompt builder sees shapes only and the number of tiles alone cannot
tell 2 x 3 from 3 x 2. ``image_url.detail: "low"`` is the global view alone.

Worker half: per image, float pixel_values (n, 3, h, w) with h, w <= the tower's side, a bool
pixel_attention_mask (n, h, w) and a tile_grid of shape (rows + 1, cols + 1), n = 1 + rows * cols
(1 when unsplit); tiles padded to the tower's side and joined under one batch axis.
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

__all__ = ["STYLE", "TILE_GRID", "Tiled"]

# Idefics3's tile grid, said in a tensor's *shape* (rows + 1, cols + 1): the prompt builder sees the
# shapes of an image's cached tensors only, and the number of tiles alone cannot tell 2 x 3 from
# 3 x 2. The tensor is a few zero bytes in the arena; the worker checks it against the tiles.
TILE_GRID = "tile_grid"


def _idefics3_outputs(pre: PromptContext, out: Mapping[str, Any]) -> dict[str, Any]:
    """Idefics3: the processor's ``rows``/``cols`` (values) become TILE_GRID's shape."""
    arrays = dict(out)
    rows, cols = int(np.asarray(arrays.pop("rows")).reshape(-1)[0]), int(np.asarray(arrays.pop("cols")).reshape(-1)[0])
    arrays[TILE_GRID] = np.zeros((rows + 1, cols + 1), dtype=np.uint8)
    # One image, so the batch axis goes (the content cache's index holds tensors of at most 4 axes;
    # the worker puts it back); the mask as bool (the processor's int64 is 8x the bytes).
    arrays[PIXEL_VALUES] = np.asarray(arrays[PIXEL_VALUES])[0]
    arrays["pixel_attention_mask"] = np.asarray(arrays["pixel_attention_mask"])[0].astype(bool)
    return arrays


def _idefics3_expand(pre: PromptContext, spec: ImageSpec) -> list[int]:
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
    return expansion_ids(pre, rows, cols)


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


def _idefics3_seq_len(config: Any) -> int:
    """Image tokens per tile: the tower's patches, pixel-shuffled by ``scale_factor`` in each direction."""
    side = int(config.vision_config.image_size) // int(config.vision_config.patch_size)
    return side * side // int(config.scale_factor) ** 2


def expansion_ids(pre: PromptContext, rows: int, cols: int) -> list[int]:
    """Idefics3: the token ids of one image with a ``rows`` x ``cols`` tile grid (memoised in the
    checkpoint's ``style_state``; call without the tokenizer lock held)."""
    expansions: dict[tuple[int, int], list[int]] = pre.style_state
    key = (rows, cols)
    if key not in expansions:
        seq_len = int(pre.processor_settings.get("image_seq_len") or _idefics3_seq_len(pre.model_config))
        names = tuple(
            getattr(pre.tokenizer, attribute, None) or default
            for attribute, default in (
                ("fake_image_token", "<fake_token_around_image>"),
                ("image_token", "<image>"),
                ("global_image_token", "<global-img>"),
            )
        )
        with pre.tokenizer_lock:
            ids = pre.tokenizer.encode(_idefics3_text(rows, cols, seq_len, *names), add_special_tokens=False)
        expansions[key] = [int(i) for i in ids]
    return expansions[key]


class Tiled(FamilyStyle):
    name = "tiled"
    image_token = "<image>"
    call_args = (("return_row_col_info", True),)
    image_tensors = ("pixel_values", "pixel_attention_mask", "tile_grid")
    host_tensors = ("tile_grid",)

    def prepare(self, pre: PromptContext) -> Any:
        return {}  # (rows, cols) -> the image's token ids

    def low_detail(self, image_processor: Any) -> dict[str, Any]:
        return {"do_image_splitting": False}

    def outputs(self, pre: PromptContext, out: Mapping[str, Any]) -> dict[str, Any]:
        return _idefics3_outputs(pre, out)

    def expand(self, pre: PromptContext, ids: np.ndarray, slots: np.ndarray, images: Sequence[ImageSpec]) -> np.ndarray:
        return splice_images(ids, slots, [_idefics3_expand(pre, spec) for spec in images])

    def layout(self, config: Any, common: dict[str, Any]) -> InputLayout:
        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        return InputLayout(
            self, **common, image_size=vision.image_size, tokens_per_image=side * side // config.scale_factor**2
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
        """The images' tiles are padded to the tower's side (mask False there, as the processor pads a
        batch) and joined along the tile axis under one batch axis, as the processor does for one prompt."""
        import torch
        import torch.nn.functional as F

        rid = item.request_id
        masks, tile_grids = item.tensors.get("pixel_attention_mask", []), item.tensors.get("tile_grid", [])
        if not len(pixels) == len(masks) == len(tile_grids) or "image_grid_thw" in item.tensors:
            raise InvalidRequest(f"Request {rid}: each image needs pixel_values, pixel_attention_mask and tile_grid.")
        side, tiles = layout.image_size, 0
        padded_pixels, padded_masks = [], []
        for p, m, g in zip(pixels, masks, tile_grids):
            rows, cols = (g.shape[0] - 1, g.shape[1] - 1) if g.dim() == 2 else (-1, -1)
            n = 1 + rows * cols if rows > 0 and cols > 0 else 1
            if (
                rows < 0
                or (rows == 0) != (cols == 0)
                or p.dim() != 4
                or not p.is_floating_point()
                or tuple(p.shape[:2]) != (n, 3)
                or max(p.shape[2:]) > side
                or m.dtype != torch.bool
                or tuple(m.shape) != (n, *p.shape[2:])
            ):
                raise InvalidRequest(
                    f"Request {rid}: an image's tiles are not (1 + rows * cols, 3, <= {side}, "
                    f"<= {side}) with a matching pixel_attention_mask and tile_grid."
                )
            pad = (0, side - p.shape[3], 0, side - p.shape[2])
            padded_pixels.append(F.pad(p, pad))
            padded_masks.append(F.pad(m, pad))
            tiles += n
        if int((ids == layout.image_token_id).sum()) != tiles * layout.tokens_per_image:
            raise InvalidRequest(f"Request {rid}: the prompt's image slots do not match its images' tiles.")
        input_ids = torch.from_numpy(ids.astype(np.int64)).view(1, -1).to(device)
        if not pixels:
            return ModelInputs(input_ids, None, None)
        return ModelInputs(
            input_ids, torch.cat(padded_pixels)[None].to(device), None, torch.cat(padded_masks)[None].to(device)
        )


STYLE = Tiled()
