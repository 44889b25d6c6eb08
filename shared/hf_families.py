"""The Hugging Face chat families ``hf:<directory>`` serves: one record per config.json ``model_type``.

Both halves read the same record, so they cannot disagree about a family: the frontend
(gateway/preprocess/hf.py) how a prompt counts and lays out each image's tokens (``prompt``) and which
image processor classes its checkpoints load (``image_processors``); the worker (worker/backends/hf.py)
how the model takes its image inputs and positions (``inputs``). A style names code that lives in one
half (gateway/ and worker/ never import each other, so the code cannot live here): a family that prompts
and runs like a known one is one record; a new style is also one entry in that half's table, and
tests/test_model_contract.py checks that every style has one. The record is data only (no transformers
import): a frontend or a worker reads it before loading anything.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass

__all__ = ["HF_FAMILIES", "HFFamily", "InputStyle", "PromptStyle", "chat_family", "unsupported_model_type"]


class PromptStyle(enum.Enum):
    """How the frontend turns each image placeholder into the model's image tokens."""

    MERGED_PATCHES = "merged-patches"  # Qwen2-VL: one token per merge x merge block of the image's patches
    CLIP_PATCHES = "clip-patches"  # LLaVA-1.5: one per patch of the fixed-size CLIP view (+ CLS, per config)
    TILES = "tiles"  # Idefics3: tile and global-view markers around each view's tokens
    COUNTED = "counted"  # LLaVA-NeXT: a count from the original image size, carried as a tensor's shape
    SIGLIP_PATCHES = "siglip-patches"  # PaliGemma: image_seq_length tokens of a fixed-size SigLIP view
    WRAPPED = "wrapped"  # Gemma 3: "\n\n" <boi> N x <image> <eoi> "\n\n", the newlines tokenized as text
    CROPS = "crops"  # InternVL: <img> image_seq_length <IMG_CONTEXT> per crop </img>


class InputStyle(enum.Enum):
    """How the worker checks an item's tensors and feeds them and the positions to the model."""

    MROPE = "mrope"  # Qwen2-VL: patches with image_grid_thw, 3-D multimodal RoPE positions
    FIXED_SIZE = "fixed-size"  # LLaVA-1.5: one (1, 3, S, S) view per image, 1-D positions
    TILED = "tiled"  # Idefics3: tiles, a pixel mask and a tile_grid per image, 1-D positions
    ANY_RESOLUTION = "any-resolution"  # LLaVA-NeXT: tiles fitted to grid_pinpoints, image_sizes beside
    TOKEN_TYPES = "token-types"  # Gemma 3: token_type_ids mark image tokens (bidirectional attention)
    PREFIX_LM = "prefix-lm"  # PaliGemma: the whole prompt is the prefix, positions from 1
    CROPS = "crops"  # InternVL: (n, 3, S, S) crops per image, 1-D positions


@dataclass(frozen=True)
class HFFamily:
    """Everything the frontend and the worker need to know about one family, beside its checkpoint."""

    model_type: str  # config.json's, the key
    name: str  # what docs/MODELS.md calls it
    # The image processor classes (without the Pil/Fast backend suffix) its checkpoints load; another
    # is refused at start-up, since the prompt style assumes this processor's output.
    image_processors: tuple[str, ...]
    prompt: PromptStyle
    inputs: InputStyle
    # PaliGemma's prefix-LM prompt: BOS right after the images, "\n" at the end, and a plain template
    # (one user turn: the images' placeholders, then its text) when the checkpoint carries none.
    prefix_lm_prompt: bool = False


_QWEN = ("Qwen2VLImageProcessor",)  # the three Qwen generations share Qwen2-VL's image processor
_TILES = ("Idefics3ImageProcessor", "SmolVLMImageProcessor")  # SmolVLM's is Idefics3's under its own name

# The order is the one start-up errors and docs/MODELS.md list.
HF_FAMILIES: dict[str, HFFamily] = {
    family.model_type: family
    for family in (
        HFFamily("qwen2_vl", "Qwen2-VL", _QWEN, PromptStyle.MERGED_PATCHES, InputStyle.MROPE),
        HFFamily("qwen2_5_vl", "Qwen2.5-VL", _QWEN, PromptStyle.MERGED_PATCHES, InputStyle.MROPE),
        HFFamily("qwen3_vl", "Qwen3-VL", _QWEN, PromptStyle.MERGED_PATCHES, InputStyle.MROPE),
        HFFamily("llava", "LLaVA-1.5", ("CLIPImageProcessor",), PromptStyle.CLIP_PATCHES, InputStyle.FIXED_SIZE),
        HFFamily("idefics3", "Idefics3, SmolVLM", _TILES, PromptStyle.TILES, InputStyle.TILED),
        HFFamily(
            "llava_next", "LLaVA-NeXT", ("LlavaNextImageProcessor",), PromptStyle.COUNTED, InputStyle.ANY_RESOLUTION
        ),
        HFFamily("gemma3", "Gemma 3", ("Gemma3ImageProcessor",), PromptStyle.WRAPPED, InputStyle.TOKEN_TYPES),
        HFFamily(
            "paligemma",
            "PaliGemma",
            ("SiglipImageProcessor",),
            PromptStyle.SIGLIP_PATCHES,
            InputStyle.PREFIX_LM,
            prefix_lm_prompt=True,
        ),
        HFFamily("internvl", "InternVL", ("GotOcr2ImageProcessor",), PromptStyle.CROPS, InputStyle.CROPS),
        HFFamily("smolvlm", "SmolVLM2", _TILES, PromptStyle.TILES, InputStyle.TILED),
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
