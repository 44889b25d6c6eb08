"""Model backends by name. An explicit table: no import-by-string plugins."""

from __future__ import annotations

import torch

from shared.embedding_models import embedding_model_type
from worker.backends.base import ModelBackend

__all__ = ["load_backend"]


def load_backend(
    model: str,
    device: torch.device,
    *,
    threads: int | None = None,
    dtype: str = "auto",
    compile_normalise: bool = False,
) -> ModelBackend:
    """Build the backend serving ``model``. Raises ValueError for an unknown model or dtype.

    ``dtype`` (``auto``, ``float32``, ``bfloat16``, ``float16``) applies to ``hf:`` models;
    the classifier runs float32 and the checksum backend has no weights. ``compile_normalise``
    applies to the classifier (worker/backends/efficientnet.py: why it is opt-in).
    """
    if model == "efficientnet-lite0":
        from worker.backends.efficientnet import EfficientNetBackend

        return EfficientNetBackend(device, threads=threads, compile_normalise=compile_normalise)
    if model == "checksum":
        from worker.backends.checksum import ChecksumBackend

        return ChecksumBackend()
    if model.startswith("hf:"):
        from worker.backends.hf import DTYPES, HFBackend, model_id_for

        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
        if embedding_model_type(model[3:]):  # CLIP / SigLIP / SigLIP2: /v1/embeddings only
            from worker.backends.hf_embed import HFEmbeddingBackend

            return HFEmbeddingBackend(model[3:], device, name=model_id_for(model[3:]), threads=threads,
                                      dtype=DTYPES[dtype])
        return HFBackend(model[3:], device, threads=threads, dtype=DTYPES[dtype])
    if model.startswith("checksum:hf:"):
        # Digests of what the HF preprocessor sent, instead of the model (gateway/preprocess/__init__.py).
        from worker.backends.checksum import ChecksumBackend
        from worker.backends.hf import model_id_for

        return ChecksumBackend(name="checksum:" + model_id_for(model.removeprefix("checksum:hf:")))
    raise ValueError(
        f"unknown model {model!r}; known: efficientnet-lite0, checksum, hf:<directory>, checksum:hf:<directory>"
    )
