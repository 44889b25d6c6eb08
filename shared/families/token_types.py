"""Gemma 3's style: a wrapped fixed-size view per image, token types for bidirectional image attention.

Frontend half: each placeholder becomes "\n\n" <boi> image_seq_length x <image> <eoi> "\n\n", as
Gemma3Processor's text replacement gives it, done on ids (the user's text stays tokenized with control
tokens as text); pan-and-scan crops are not carried (off by default). Worker half: one float (1, 3, S,
S) view per image (fixed_size.py's check), ``token_type_ids`` 1 on image tokens at prefill (image
tokens attend to each other both ways), 1-D positions.
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
)
from shmgate.shared.families.fixed_size import check_fixed_size

if TYPE_CHECKING:
    import torch

__all__ = ["STYLE", "TokenTypes"]

# (boi, image, eoi) token names, when the tokenizer does not name them.
WRAPPED = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")


def _wrap_images(pre: PromptContext, ids: list[int]) -> list[int]:
    """Gemma 3: what Gemma3Processor's text replacement gives, done on ids (the user's text stays
    tokenized with control tokens as text): each placeholder becomes "\n\n" <boi> N x <image> <eoi>
    "\n\n", and those newlines are tokenized together with the newline tokens next to them, as they
    would be in one string (a "\n" before an image and the "\n\n" become one "\n\n\n" token)."""
    boi, image, eoi = (
        pre.named_token_id(attribute, default)
        for attribute, default in zip(("boi_token", "image_token", "eoi_token"), WRAPPED)
    )
    seq_len = int(pre.processor_settings.get("image_seq_length") or pre.model_config.mm_tokens_per_image)
    with pre.tokenizer_lock:
        newline: dict[int, str] = {t: str(pre.tokenizer.decode([t])) for t in set(ids)}
        out: list[int] = []
        pending = ""

        def flush() -> None:
            nonlocal pending
            if pending:
                out.extend(int(i) for i in pre.tokenizer.encode(pending, add_special_tokens=False))
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


class TokenTypes(FamilyStyle):
    name = "token-types"
    image_token = WRAPPED[0]
    token_attribute = "boi_token"
    image_tensors = ("pixel_values",)

    def outputs(self, pre: PromptContext, out: Mapping[str, Any]) -> dict[str, Any]:
        return {PIXEL_VALUES: out[PIXEL_VALUES]}

    def expand(self, pre: PromptContext, ids: np.ndarray, slots: np.ndarray, images: Sequence[ImageSpec]) -> np.ndarray:
        for spec in images:
            if PIXEL_VALUES not in spec or len(spec) != 1:
                raise InvalidRequest("An image's tensors were not made by this preprocessor.")
        return np.asarray(_wrap_images(pre, ids.tolist()), dtype=np.int32)

    def layout(self, config: Any, common: dict[str, Any]) -> InputLayout:
        return InputLayout(
            self, **common, image_size=config.vision_config.image_size, tokens_per_image=config.mm_tokens_per_image
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
        return check_fixed_size(layout, item, ids, pixels, grids, device)

    def extra_inputs(self, layout: InputLayout, ids: torch.Tensor, prompt_tokens: int) -> dict[str, Any]:
        # image tokens attend to each other both ways
        return {"token_type_ids": (ids == layout.image_token_id).long()}


STYLE = TokenTypes()
