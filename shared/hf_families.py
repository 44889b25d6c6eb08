"""The Hugging Face chat families ``hf:<directory>`` serves: one record per config.json ``model_type``.

Both halves read the same record, so they cannot disagree about a family: which image processor
classes its checkpoints load (``image_processors``) and its input style (``style``), the module of
shared/families/ that holds both halves' knowledge of it: how the frontend (gateway/preprocess/hf.py)
counts and lays out each image's tokens, and how the worker (worker/backends/hf.py) checks an item's
tensors, feeds them to the model and computes its positions. A family that prompts and runs like a
known one is one record here; a family with a new style is also one module in shared/families/
(tests/test_model_contract.py checks that every style implements the whole contract). The records
import no transformers and no torch: a frontend or a worker reads them before loading anything.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from shmgate.shared.families import FamilyStyle, any_resolution, crops, fixed_size, mrope, prefix_lm, tiled, token_types

__all__ = ["HF_FAMILIES", "HFFamily", "chat_family", "unsupported_model_type"]


@dataclass(frozen=True)
class HFFamily:
    """Everything the frontend and the worker need to know about one family, beside its checkpoint."""

    model_type: str  # config.json's, the key
    name: str  # what docs/MODELS.md calls it
    # The image processor classes (without the Pil/Fast backend suffix) its checkpoints load; another
    # is refused at start-up, since the style assumes this processor's output.
    image_processors: tuple[str, ...]
    style: FamilyStyle  # both halves' code for its inputs (shared/families/)
    # Its vision tower runs apart from the prompt in the worker (``get_image_features`` gives one output per
    # image, scattered into the prompt's embeddings as the model does): its images' outputs are cached by
    # content key and its prompts can be prefilled in chunks. Qwen3-VL also feeds deepstack features into
    # its first layers, which that path does not carry, so it stays on the model's own path.
    encoder_apart: bool = False


_QWEN = ("Qwen2VLImageProcessor",)  # the three Qwen generations share Qwen2-VL's image processor
_TILES = ("Idefics3ImageProcessor", "SmolVLMImageProcessor")  # SmolVLM's is Idefics3's under its own name

# The order is the one start-up errors and docs/MODELS.md list.
HF_FAMILIES: dict[str, HFFamily] = {
    family.model_type: family
    for family in (
        HFFamily("qwen2_vl", "Qwen2-VL", _QWEN, mrope.STYLE, encoder_apart=True),
        HFFamily("qwen2_5_vl", "Qwen2.5-VL", _QWEN, mrope.STYLE, encoder_apart=True),
        HFFamily("qwen3_vl", "Qwen3-VL", _QWEN, mrope.STYLE),
        HFFamily("llava", "LLaVA-1.5", ("CLIPImageProcessor",), fixed_size.STYLE),
        HFFamily("idefics3", "Idefics3, SmolVLM", _TILES, tiled.STYLE),
        HFFamily("llava_next", "LLaVA-NeXT", ("LlavaNextImageProcessor",), any_resolution.STYLE),
        HFFamily("gemma3", "Gemma 3", ("Gemma3ImageProcessor",), token_types.STYLE),
        HFFamily("paligemma", "PaliGemma", ("SiglipImageProcessor",), prefix_lm.STYLE),
        HFFamily("internvl", "InternVL", ("GotOcr2ImageProcessor",), crops.STYLE),
        HFFamily("smolvlm", "SmolVLM2", _TILES, tiled.STYLE),
    )
}


def chat_family(directory: str) -> HFFamily:
    """The family of the checkpoint in ``directory``, from ``config.json``'s model_type read as plain JSON
    (constructing an unknown architecture's config could fail first with a less useful error). Raises
    ValueError naming the model_type when chat does not serve it."""
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        model_type = str(json.load(f).get("model_type", ""))
    if model_type not in HF_FAMILIES:
        raise ValueError(unsupported_model_type(directory, model_type))
    return HF_FAMILIES[model_type]


def unsupported_model_type(directory: str, model_type: str) -> str:
    """The start-up error for a checkpoint whose architecture hf: chat does not serve."""
    return (
        f"{directory}: model_type {model_type!r} is not supported for chat; supported: "
        f"{', '.join(HF_FAMILIES)} (docs/MODELS.md lists the families)"
    )
