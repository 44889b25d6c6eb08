"""Embeddings from a dual-tower checkpoint served as ``hf:<directory>``: CLIP, SigLIP, SigLIP2.

Image items carry the image processor's tensors (gateway/preprocess/embed_hf.py); text items carry
int32 token ids inline (``[1, ids..., mask...]``, or ``[0, ids...]`` without an attention mask). A batch
runs the image tower once over all its image items (``get_image_features``: vision tower, then
CLIP's projection or SigLIP's pooling head) and the text tower once over all its text items
(``get_text_features``), so image and text vectors share the model's space. Each vector is
unit-normalised in float32 and goes back as little-endian float32 bytes (worker/vectors.py).

Every image of one checkpoint has the same tensor shapes (CLIP/SigLIP: a fixed resize; SigLIP2:
patches padded to ``max_num_patches``), and every text the same length (padded to the text
tower's length), so items concatenate without padding here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from shmgate.shared.embedding_models import EMBEDDING_MODEL_TYPES
from shmgate.shared.errors import InvalidRequest
from shmgate.worker.backends.base import BackendEvent, ModelBackend, WorkItem
from shmgate.worker.vectors import unit_vectors

__all__ = ["HFEmbeddingBackend"]

PIXEL_VALUES = "pixel_values"


def _pooled(output: Any) -> torch.Tensor:
    """``get_*_features`` returns the pooled tensor (transformers 4.x) or an output with pooler_output (5.x)."""
    pooled: torch.Tensor = output if isinstance(output, torch.Tensor) else output.pooler_output
    return pooled


class HFEmbeddingBackend(ModelBackend):
    """Serves ``/v1/embeddings`` for a CLIP / SigLIP / SigLIP2 directory (fp32 on CPU, bf16 on CUDA by default)."""

    embeds = True

    def __init__(
        self,
        model_dir: str,
        device: torch.device,
        *,
        name: str,
        dtype: torch.dtype | None = None,
        threads: int | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoModel

        model_type = AutoConfig.from_pretrained(model_dir).model_type
        if model_type not in EMBEDDING_MODEL_TYPES:
            raise ValueError(f"{model_dir}: model type {model_type!r} is not an embedding model")
        if threads is not None:
            torch.set_num_threads(threads)
        self.name = name
        self.device = device
        self.dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        self.model: Any = AutoModel.from_pretrained(model_dir, dtype=self.dtype).to(device).eval()

    def run(self, batch: Sequence[WorkItem]) -> Iterator[BackendEvent]:
        """One image-tower pass and one text-tower pass over the batch's live items; a vector per item."""
        images = [i for i, item in enumerate(batch) if not item.cancelled and PIXEL_VALUES in item.tensors]
        texts = [i for i, item in enumerate(batch) if not item.cancelled and PIXEL_VALUES not in item.tensors]
        for i, item in enumerate(batch):
            if item.cancelled:
                yield BackendEvent(i, finish_reason="stop")
        with torch.inference_mode():
            if images:
                names = batch[images[0]].tensors.keys()
                inputs = {name: torch.cat([batch[i].tensors[name][0] for i in images]) for name in names}
                inputs[PIXEL_VALUES] = inputs[PIXEL_VALUES].to(self.dtype)
                vectors = unit_vectors(_pooled(self.model.get_image_features(**inputs)))
                for i, vector in zip(images, vectors):
                    yield BackendEvent(i, vector=vector)
                    yield BackendEvent(i, finish_reason="stop")
            if texts:
                ids, mask, counts = self._text_inputs([batch[i] for i in texts])
                vectors = unit_vectors(_pooled(self.model.get_text_features(input_ids=ids, attention_mask=mask)))
                for i, vector, n in zip(texts, vectors, counts):
                    yield BackendEvent(i, vector=vector)
                    yield BackendEvent(i, finish_reason="stop", prompt_tokens=n)

    def _text_inputs(self, items: Sequence[WorkItem]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """Token ids (N, L) int64 on the device, the attention mask or None, and real tokens per item."""
        rows = [np.frombuffer(item.inline, dtype=np.int32) for item in items]
        if len({(len(row), int(row[0])) for row in rows if len(row)}) != 1 or any(len(row) < 2 for row in rows):
            raise InvalidRequest("text items must carry token ids of the text tower's length")
        table = torch.from_numpy(np.stack(rows)[:, 1:].astype(np.int64))
        if int(rows[0][0]) == 0:  # no mask
            return table.to(self.device), None, [table.shape[1]] * len(rows)
        if table.shape[1] % 2:
            raise InvalidRequest("a text item's mask must be as long as its token ids")
        ids, mask = table.chunk(2, dim=1)
        return ids.to(self.device), mask.to(self.device), mask.sum(dim=1).tolist()
