"""Frontend halves of the models: decode and preprocess into arena tensors, build prompts.

``get_preprocessor`` is an explicit table from model name to class; the
imports sit inside it so a frontend serving one model never imports another's
dependencies (transformers, for instance).
"""

from __future__ import annotations

from gateway.preprocess.base import Preprocessor
from shared.embedding_models import embedding_model_type

__all__ = ["get_preprocessor"]


def get_preprocessor(model: str, *, max_images: int = 8) -> Preprocessor:
    """The preprocessor for ``model``. Raises ValueError for an unknown model."""
    if model == "efficientnet-lite0":
        from gateway.preprocess.vision import EfficientNetPreprocessor

        return EfficientNetPreprocessor(max_images=max_images)
    if model == "checksum":
        from gateway.preprocess.vision import ChecksumPreprocessor

        return ChecksumPreprocessor(max_images=max_images)
    if model.startswith("hf:") and embedding_model_type(model[3:]):
        from gateway.preprocess.embed_hf import HFEmbeddingPreprocessor

        return HFEmbeddingPreprocessor(model[3:], max_images=max_images)
    if model.startswith("hf:"):
        from gateway.preprocess.hf import HFPreprocessor

        return HFPreprocessor(model[3:], max_images=max_images)
    if model.startswith("checksum:hf:"):
        # The transport's witness for a real processor: the HF preprocessing feeds a worker
        # that answers with digests (worker/backends/checksum.py), served as checksum:<name>.
        from gateway.preprocess.hf import HFPreprocessor, model_id_for

        directory = model.removeprefix("checksum:hf:")
        return HFPreprocessor(directory, max_images=max_images, model_id="checksum:" + model_id_for(directory))
    raise ValueError(
        f"unknown model {model!r}; known: efficientnet-lite0, checksum, hf:<directory>, checksum:hf:<directory>"
    )
