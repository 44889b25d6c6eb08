"""Which ``hf:<dir>`` checkpoints are embedding models (CLIP, SigLIP, SigLIP2), read from config.json.

Both halves need the answer: the frontend picks the embedding preprocessor, the worker the
embedding backend. It lives here so neither imports the other, and it reads the JSON file
itself (no transformers import) because a frontend decides before anything else is loaded.
"""

from __future__ import annotations

import json
import os

__all__ = ["EMBEDDING_MODEL_TYPES", "embedding_model_type"]

# config.json "model_type" of the dual-tower (image + text) models served on /v1/embeddings only.
EMBEDDING_MODEL_TYPES = ("clip", "siglip", "siglip2")


def embedding_model_type(model_dir: str | os.PathLike[str]) -> str | None:
    """The checkpoint's model_type when it is one of EMBEDDING_MODEL_TYPES, else None (also when unreadable)."""
    try:
        with open(os.path.join(os.fspath(model_dir), "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return model_type if model_type in EMBEDDING_MODEL_TYPES else None
