"""Frontend half of a dual-tower embedding model served as ``hf:<directory>`` (CLIP, SigLIP, SigLIP2).

Images: the checkpoint's own image processor (PIL backend, as gateway/preprocess/hf.py pins it)
writes its outputs into the arena once, by name: ``pixel_values`` for CLIP and SigLIP (float32
``[1, 3, H, W]``); SigLIP2 adds ``pixel_attention_mask`` and ``spatial_shapes`` (its patches are
padded to ``max_num_patches``, so every image of a checkpoint has the same shapes and batches).

Text: the tokenizer, padded to the text tower's length (``padding="max_length"``, as SigLIP was
trained and as its processor does; CLIP pools at the end-of-text token, so padding does not change
its features), on the side the directory's tokenizer pads. The ids ride inline as int32:
``[1, ids..., mask...]`` with the attention mask, or ``[0, ids...]`` when the tokenizer returns none
(the worker then passes none, as the model's own processor would).

The model never runs here and its weights are never opened; only the processor files and
config.json are read. Chat requests are not served for these models (gateway/embeddings.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from shmgate.gateway.imaging import decode_image
from shmgate.gateway.preprocess.base import AllocateFn, ImageTensorSpec, Preprocessor, PromptInputs
from shmgate.gateway.preprocess.hf import model_id_for
from shmgate.shared.errors import InvalidRequest, UndecodableImage

__all__ = ["HFEmbeddingPreprocessor", "text_inline"]


def text_inline(ids: Sequence[int], mask: Sequence[int] | None) -> bytes:
    """The inline payload of a text input: int32 ``[1, ids..., mask...]`` or ``[0, ids...]`` (module docstring)."""
    return np.asarray([0, *ids] if mask is None else [1, *ids, *mask], dtype=np.int32).tobytes()


class HFEmbeddingPreprocessor(Preprocessor):
    """Image processor and tokenizer of a CLIP / SigLIP / SigLIP2 directory; thread-safe, no state per call."""

    prompt_is_cheap = False  # tokenizing takes a fraction of a millisecond: keep it off the loop
    serves_chat = False  # /v1/embeddings only
    embeds_text = True

    def __init__(self, model_dir: str | os.PathLike[str], *, max_images: int = 8) -> None:
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        path = os.fspath(model_dir)
        self.model = model_id_for(path)
        self.max_images = max_images
        self.image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
        text_config = config.text_config
        self.max_text_tokens = min(
            int(text_config.max_position_embeddings), int(getattr(self.tokenizer, "model_max_length", 1 << 30))
        )
        # CLIP projects both towers to projection_dim; SigLIP's towers end at their hidden size.
        self.embedding_dim = int(getattr(config, "projection_dim", None) or text_config.hidden_size)
        self._cache_params = json.dumps(
            {
                "kind": "hf-embed/1",
                "image_processor": type(self.image_processor).__name__,
                "config": self.image_processor.to_dict(),
            },
            sort_keys=True,
            default=str,
        ).encode()

    def cache_params(self) -> bytes:
        return self._cache_params

    def preprocess_image(
        self, data: bytes, allocate: AllocateFn, *, max_pixels: int, options: dict[str, Any] | None = None
    ) -> None:
        """Decode, run the image processor, copy each output into the arena once (after success).
        ``options`` is always empty: the configured processor (``Preprocessor.image_options``)."""
        image = decode_image(data, max_pixels=max_pixels)
        try:
            out = self.image_processor(images=[image], return_tensors="np", input_data_format="channels_last")
        except ValueError as exc:
            raise UndecodableImage(f"The image cannot be processed for this model: {exc}") from None
        arrays = {name: np.ascontiguousarray(value) for name, value in out.items()}
        for name, array in arrays.items():
            np.copyto(allocate(name, array.dtype.name, tuple(array.shape)), array, casting="no")

    def build_prompt(self, messages: Sequence[dict[str, Any]], images: Sequence[ImageTensorSpec]) -> PromptInputs:
        """Nothing for an image input; a text input's token ids (module docstring) for a text one."""
        if images:
            return PromptInputs()
        text = "\n".join(part["text"] for m in messages for part in m["content"] if part["type"] == "text")
        if not text:
            raise InvalidRequest("an embedding input is empty", param="input")
        encoded = self.tokenizer(text, padding="max_length", truncation=True, max_length=self.max_text_tokens)
        mask = encoded.get("attention_mask")
        n_tokens = int(sum(mask)) if mask is not None else len(encoded["input_ids"])
        return PromptInputs(inline=text_inline(encoded["input_ids"], mask), prompt_tokens=n_tokens)
