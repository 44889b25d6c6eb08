"""The model registry: what a ``--model`` spec names, said once for both halves.

A spec is one of ``efficientnet-lite0``, ``checksum``, ``hf:<directory>`` or ``checksum:hf:<directory>``.
``parse_model_spec`` turns it into a ``ModelSpec``: its kind, the public id the model is served under
(the ``model`` field clients send, the worker's name, and the id the frontend stamps on each Submit)
and the checkpoint directory. The frontend picks its preprocessor and the worker its backend by
``kind`` (gateway/preprocess/__init__.py, worker/backends/__init__.py); neither parses the string
itself, so the two halves cannot disagree about a model's id. What an ``hf:`` chat checkpoint's family
(config.json ``model_type``) needs from each half is its record in shared/hf_families.py.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from shared.embedding_models import embedding_model_type

__all__ = ["KNOWN_SPECS", "ModelKind", "ModelSpec", "model_id_for", "parse_model_spec"]

KNOWN_SPECS = "efficientnet-lite0, checksum, hf:<directory>, checksum:hf:<directory>"


class ModelKind(enum.Enum):
    EFFICIENTNET = "efficientnet"  # the embedded ImageNet classifier
    CHECKSUM = "checksum"  # digests of the received tensors: the transport's witness in tests
    HF_CHAT = "hf"  # a local Hugging Face image-text-to-text checkpoint (/v1/chat/completions)
    HF_EMBED = "hf-embed"  # a CLIP / SigLIP / SigLIP2 checkpoint (/v1/embeddings only)
    CHECKSUM_HF = "checksum-hf"  # the HF preprocessing of a checkpoint, answered with digests


@dataclass(frozen=True)
class ModelSpec:
    kind: ModelKind
    public_id: str  # what clients send as "model" and what the worker answers to
    directory: str | None = None  # the checkpoint, for the hf kinds


def model_id_for(model_dir: str | os.PathLike[str]) -> str:
    """The id a model directory is served under: its base name (``/m/Qwen2-VL/`` -> ``Qwen2-VL``)."""
    return os.path.basename(os.path.normpath(os.fspath(model_dir)))


def parse_model_spec(model: str) -> ModelSpec:
    """The spec ``model`` names. Raises ValueError (naming the known forms) for anything else.

    An ``hf:`` directory whose config.json names an embedding model type is HF_EMBED; the file is
    read here, without transformers (shared/embedding_models.py).
    """
    if model == "efficientnet-lite0":
        return ModelSpec(ModelKind.EFFICIENTNET, model)
    if model == "checksum":
        return ModelSpec(ModelKind.CHECKSUM, model)
    if model.startswith("hf:") and model[3:]:
        directory = model[3:]
        kind = ModelKind.HF_EMBED if embedding_model_type(directory) else ModelKind.HF_CHAT
        return ModelSpec(kind, model_id_for(directory), directory)
    if model.startswith("checksum:hf:") and model.removeprefix("checksum:hf:"):
        directory = model.removeprefix("checksum:hf:")
        return ModelSpec(ModelKind.CHECKSUM_HF, "checksum:" + model_id_for(directory), directory)
    raise ValueError(f"unknown model {model!r}; known: {KNOWN_SPECS}")
