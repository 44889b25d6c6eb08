"""The input styles of the Hugging Face chat families: one module per style, read by both halves.

A family's record (shared/hf_families.py) names its style; the frontend (gateway/preprocess/hf.py)
runs the style's frontend half (each image's tokens in the prompt, the processor outputs kept) and
the worker (worker/backends/hf.py) its worker half (checks, model inputs, positions). Each module
implements ``FamilyStyle`` (base.py) and imports torch only inside its worker-half functions, so the
frontend's import never loads it.

- mrope.py: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (merged patches, 3-D multimodal RoPE positions)
- fixed_size.py: LLaVA-1.5 (one fixed-size CLIP view per image)
- tiled.py: Idefics3, SmolVLM (tiles, a pixel mask and a tile grid per image)
- any_resolution.py: LLaVA-NeXT (tiles fitted to grid_pinpoints, image_sizes beside)
- token_types.py: Gemma 3 (wrapped image tokens, token_type_ids for bidirectional image attention)
- prefix_lm.py: PaliGemma (the prompt is the prefix, positions from 1)
- crops.py: InternVL (crops per image between <img> and </img>)
"""

from __future__ import annotations

from typing import Any

from shmgate.shared.families import any_resolution, crops, fixed_size, mrope, prefix_lm, tiled, token_types
from shmgate.shared.families.base import FamilyStyle, InputLayout, ModelInputs, PromptContext

__all__ = [
    "HOST_TENSORS",
    "IMAGE_TENSORS",
    "STYLES",
    "FamilyStyle",
    "InputLayout",
    "ModelInputs",
    "PromptContext",
    "input_layout",
]

# Every style, by name (the order docs/MODELS.md lists them in).
STYLES: dict[str, FamilyStyle] = {
    style.name: style
    for style in (
        mrope.STYLE,
        fixed_size.STYLE,
        tiled.STYLE,
        any_resolution.STYLE,
        token_types.STYLE,
        prefix_lm.STYLE,
        crops.STYLE,
    )
}
# The image tensors any style passes to a model, by TensorRef name, and those read on the host (checked
# and turned into token counts: the worker hands them over there, so checking them costs no device round
# trip per image).
IMAGE_TENSORS: tuple[str, ...] = tuple(dict.fromkeys(t for s in STYLES.values() for t in s.image_tensors))
HOST_TENSORS: tuple[str, ...] = tuple(dict.fromkeys(t for s in STYLES.values() for t in s.host_tensors))


def input_layout(style: FamilyStyle, config: Any) -> InputLayout:
    """The layout of a model of ``style`` from its config (``style.layout``), the fields every style
    shares filled in."""
    common = {
        "vocab_size": config.get_text_config().vocab_size,
        "max_positions": config.get_text_config().max_position_embeddings,
        "image_token_id": config.image_token_id,
        "accepted": frozenset(IMAGE_TENSORS),
    }
    return style.layout(config, common)
